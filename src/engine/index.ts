/** Public API of the engine folder: the node-llama-cpp engine, state-file tools, model writer. */
export type { ChatMessage, Engine, EngineInfo, FinishReason, GeneratedToken, PrefillResult, SamplingParams, Slot } from './types.js';
export { loadEngine, EngineError, TextStream, type LoadEngineOptions } from './llama.js';
export { parseStateFile, parseStateHeaders, type PositionalSource, rewriteNStream, kvBytesPerCell, GGSQ_MAGIC, GGSQ_VERSION, type ParsedState, type StateExpect, type StateStream, type StateLayerSection } from './ggsq.js';
export { writeLlamaGguf, buildLlamaGguf, ensureModel, sha256File, describeModel, defaultCacheDir, PRESETS, type GgufPreset, type ModelDims, type WriteGgufOptions } from './gguf-writer.js';
