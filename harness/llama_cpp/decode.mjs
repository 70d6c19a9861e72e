// decode.mjs -- llama.cpp's decode of a GGUF file through node-llama-cpp's prebuilt binary, driven by bench.py decode
// (harness/bench_decode.py, LlamaCpp). Install once: npm install --prefix harness/llama_cpp (see README.md).
//
// node decode.mjs MODEL.gguf THREADS CONTEXT: loads the model on the CPU (no GPU, no build, no download), prints one
// JSON line {"ready": seconds, ...}, then answers each JSON line {"prompt": [token ids], "n": new tokens} read from
// stdin with one line {"seconds": s, "first": s to the first new token, "tokens": [ids]}: the prompt evaluated
// from an empty context, then n tokens greedily (temperature 0), past an end-of-generation token as ours decode
// (yieldEogToken). {"quit": true} or the end of stdin ends it.
import {getLlama, LlamaLogLevel} from "node-llama-cpp";
import readline from "node:readline";

const [modelPath, threads, contextSize] = [process.argv[2], Number(process.argv[3] || 1), Number(process.argv[4] || 512)];
const t0 = performance.now();
const llama = await getLlama({gpu: false, build: "never", usePrebuiltBinaries: true, skipDownload: true,
                              progressLogs: false, logLevel: LlamaLogLevel.error});
const model = await llama.loadModel({modelPath, gpuLayers: 0});
const context = await model.createContext({contextSize, threads, batchSize: contextSize, sequences: 1});
const sequence = context.getSequence();
console.log(JSON.stringify({ready: (performance.now() - t0) / 1e3, build: llama.buildType, gpu: llama.gpu,
                            threads: context.currentThreads, version: llama.llamaCppRelease}));
const lines = readline.createInterface({input: process.stdin});
for await (const line of lines) {
  const req = JSON.parse(line);
  if (req.quit) break;
  await sequence.clearHistory();
  const tokens = [];
  let first = null;
  const start = performance.now();
  for await (const token of sequence.evaluate(req.prompt, {temperature: 0, yieldEogToken: true})) {
    tokens.push(token);
    if (first === null) first = (performance.now() - start) / 1e3;
    if (tokens.length >= req.n) break;
  }
  console.log(JSON.stringify({seconds: (performance.now() - start) / 1e3, first, tokens}));
}
await context.dispose();
await model.dispose();
await llama.dispose();
