// Classifies, scores and reranks through vllm_servicer.v1.Pooling on a
// vllm-servicer server running a classification model (a cross-encoder for
// Score and Rerank), using the .proto files the package ships, with
// @grpc/grpc-js and @grpc/proto-loader.
//
//   npm install && node rerank.js 127.0.0.1:50051 [api_key]   # key default: $VLLM_API_KEY
//
// Prints one line per call, the call's name and its results as JSON:
//   classify: [{"index":0,"label":"relevant","probs":[0.51]},...]
//   score: [{"index":0,"score":0.51},...]
//   rerank: [{"index":2,"relevance_score":0.52,"document":"..."},...]
"use strict";

const path = require("path");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");

const PROTOS = path.join(__dirname, "..", "..", "src", "vllm_servicer", "proto");
const definition = protoLoader.loadSync("vllm_servicer/v1/pooling.proto", {
  includeDirs: [PROTOS],
  keepCase: true,
  longs: Number,
  defaults: true,
});
const { Pooling } = grpc.loadPackageDefinition(definition).vllm_servicer.v1;

const address = process.argv[2] || "127.0.0.1:50051";
const apiKey = process.argv[3] || process.env.VLLM_API_KEY;
const metadata = new grpc.Metadata();
if (apiKey) {
  metadata.set("authorization", `Bearer ${apiKey}`);
}
const client = new Pooling(address, grpc.credentials.createInsecure());

const QUERY = "What is the capital of France?";
const DOCUMENTS = [
  "Paris is the capital and largest city of France.",
  "The Eiffel Tower was finished in 1889.",
  "Berlin is the capital of Germany.",
  "France borders Spain, Italy and Germany.",
];

// A unary call as a promise.
function call(method, request) {
  const deadline = Date.now() + 60_000;
  return new Promise((resolve, reject) => {
    client[method](request, metadata, { deadline }, (err, response) =>
      err ? reject(err) : resolve(response),
    );
  });
}

async function main() {
  // One label distribution per text.
  const classified = await call("Classify", { input: [QUERY, DOCUMENTS[0]] });
  const labels = classified.results.map((r) => ({
    index: r.index,
    label: r.label,
    probs: r.probs,
  }));
  console.log("classify:", JSON.stringify(labels));

  // The query scored against each text, in the texts' order.
  const scored = await call("Score", { text_1: QUERY, text_2: DOCUMENTS.slice(0, 3) });
  const scores = scored.results.map((r) => ({ index: r.index, score: r.score }));
  console.log("score:", JSON.stringify(scores));

  // The three most relevant documents, most relevant first, with their text.
  const reranked = await call("Rerank", {
    query: QUERY,
    documents: DOCUMENTS,
    top_n: 3,
    return_documents: true,
  });
  const ranking = reranked.results.map((r) => ({
    index: r.index,
    relevance_score: r.relevance_score,
    document: r.document,
  }));
  console.log("rerank:", JSON.stringify(ranking));
}

main()
  .catch((err) => {
    console.error("error:", grpc.status[err.code], err.details);
    process.exitCode = 1;
  })
  .finally(() => client.close());
