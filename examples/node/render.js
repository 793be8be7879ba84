// Renders a chat and two completion prompts through vllm_servicer.v1.Render
// on a vllm-servicer server: the token ids the engine would run, with no
// generation; and derenders token ids back into text (the first prompt's
// tokens, without the BOS, as if generated after the second). Uses the .proto files the package ships, with @grpc/grpc-js and
// @grpc/proto-loader.
//
//   npm install && node render.js 127.0.0.1:50051 [api_key]   # key default: $VLLM_API_KEY
//
// Prints one line per call, the call's name and its result as JSON:
//   render_chat: {"token_ids":[1,523,...],"text":"<|system|>..."}
//   render_completion: [{"token_ids":[1,...],"text":"..."},{"token_ids":[1,...],"text":"..."}]
//   derender_completion: [{"text":"Hello, world","finish_reason":"length"}]
"use strict";

const path = require("path");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");

// google/protobuf/struct.proto, which render.proto imports, comes with proto-loader.
const PROTOS = path.join(__dirname, "..", "..", "src", "vllm_servicer", "proto");
const definition = protoLoader.loadSync("vllm_servicer/v1/render.proto", {
  includeDirs: [PROTOS],
  keepCase: true,
  longs: Number,
  defaults: true,
});
const { Render } = grpc.loadPackageDefinition(definition).vllm_servicer.v1;

const address = process.argv[2] || "127.0.0.1:50051";
const apiKey = process.argv[3] || process.env.VLLM_API_KEY;
const metadata = new grpc.Metadata();
if (apiKey) {
  metadata.set("authorization", `Bearer ${apiKey}`);
}
const client = new Render(address, grpc.credentials.createInsecure());

const WEATHER_PARAMETERS = {
  type: "object",
  properties: { city: { type: "string", description: "The city's name" } },
  required: ["city"],
};

// A unary call as a promise.
function call(method, request) {
  const deadline = Date.now() + 60_000;
  return new Promise((resolve, reject) => {
    client[method](request, metadata, { deadline }, (err, response) =>
      err ? reject(err) : resolve(response),
    );
  });
}

const asJson = (prompt) => ({ token_ids: prompt.token_ids, text: prompt.text });

async function main() {
  const chat = await call("RenderChat", {
    messages: [
      { role: "system", content: "You are a helpful assistant." },
      { role: "user", content: "What is the weather in Paris?" },
    ],
    tools: [
      {
        name: "get_weather",
        description: "The current weather in a city",
        parameters: JSON.stringify(WEATHER_PARAMETERS),
      },
    ],
  });
  console.log("render_chat:", JSON.stringify(asJson(chat)));

  const completion = await call("RenderCompletion", {
    prompt: ["Hello, world", "The capital of France is"],
  });
  console.log("render_completion:", JSON.stringify(completion.prompts.map(asJson)));

  const [first, second] = completion.prompts;
  const derendered = await call("DerenderCompletion", {
    prompts: [
      {
        prompt_token_ids: second.token_ids,
        choices: [{ token_ids: first.token_ids.slice(1), finish_reason: "length" }],
      },
    ],
  });
  console.log(
    "derender_completion:",
    JSON.stringify(
      derendered.choices.map((c) => ({ text: c.text, finish_reason: c.finish_reason })),
    ),
  );
}

main()
  .catch((err) => {
    console.error("error:", grpc.status[err.code], err.details);
    process.exitCode = 1;
  })
  .finally(() => client.close());
