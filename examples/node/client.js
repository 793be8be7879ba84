// Streams tokens from a vllm-servicer (or vLLM --grpc) server, using this
// project's .proto files with @grpc/grpc-js and @grpc/proto-loader.
//
//   npm install && node client.js 127.0.0.1:50051 [max_tokens]
"use strict";

const path = require("path");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");

const PROTOS = path.join(__dirname, "..", "..", "protos");
const definition = protoLoader.loadSync("vllm_engine.proto", {
  includeDirs: [PROTOS],
  keepCase: true,
  longs: Number,
  defaults: true,
  oneofs: true,
});
const { VllmEngine } = grpc.loadPackageDefinition(definition).vllm.grpc.engine;

const address = process.argv[2] || "127.0.0.1:50051";
const maxTokens = Number(process.argv[3] || 8);
const client = new VllmEngine(address, grpc.credentials.createInsecure());

const call = client.Generate({
  request_id: "node-example-1",
  tokenized: { input_ids: [5, 17, 42, 99] },
  sampling_params: { temperature: 0, max_tokens: maxTokens, ignore_eos: true },
  stream: true,
});

let tokens = [];
call.on("data", (response) => {
  if (response.response === "chunk") {
    tokens = tokens.concat(response.chunk.token_ids);
    console.log("tokens:", JSON.stringify(response.chunk.token_ids));
  } else {
    console.log("finish_reason:", response.complete.finish_reason);
  }
});
call.on("error", (err) => {
  console.error("error:", err.code, err.details);
  process.exitCode = 1;
});
call.on("end", () => {
  console.log("total tokens:", tokens.length);
  client.close();
});
