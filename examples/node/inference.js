// Streams text from vLLM's own protocol (vllm.Inference/GenerateStream) on a
// vllm-servicer server (or vLLM's Rust frontend), using the .proto file the
// package ships, with @grpc/grpc-js and @grpc/proto-loader.
//
//   npm install && node inference.js 127.0.0.1:50051 [max_new_tokens]
"use strict";

const path = require("path");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");

const PROTOS = path.join(__dirname, "..", "..", "src", "vllm_servicer", "proto");
const definition = protoLoader.loadSync("inference.proto", {
  includeDirs: [PROTOS],
  keepCase: true,
  longs: Number,
  defaults: true,
  oneofs: true,
});
const { Inference } = grpc.loadPackageDefinition(definition).vllm;

const address = process.argv[2] || "127.0.0.1:50051";
const maxNewTokens = Number(process.argv[3] || 8);
const client = new Inference(address, grpc.credentials.createInsecure());

// Temperature omitted: greedy, the protocol's default.
const call = client.GenerateStream({
  request_id: "node-inference-1",
  token_ids: { ids: [5, 17, 42, 99] },
  stopping: { max_new_tokens: maxNewTokens, ignore_eos: true },
  response: { output_token_ids: true },
});

const reasons = ["NOT_FINISHED", "LENGTH", "STOP", "ABORTED"];
let text = "";
let tokens = 0;
call.on("data", (response) => {
  if (response.prompt_info) {
    console.log("prompt tokens:", response.prompt_info.num_prompt_tokens);
  }
  const out = response.outputs;
  if (!out) {
    return;
  }
  text += out.text;
  tokens += out.num_tokens;
  console.log("tokens:", JSON.stringify(out.token_ids));
  if (out.finish_info) {
    const reason = out.finish_info.finish_reason;
    console.log("finish_reason:", typeof reason === "number" ? reasons[reason] : reason);
    console.log("output tokens:", out.finish_info.num_output_tokens);
  }
});
call.on("error", (err) => {
  console.error("error:", err.code, err.details);
  process.exitCode = 1;
});
call.on("end", () => {
  console.log("text:", JSON.stringify(text));
  console.log("total tokens:", tokens);
  client.close();
});
