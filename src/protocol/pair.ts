/**
 * The settings a prefill–decode pair must share (`PairSettings`, exchanged in the KV handshake
 * and shown on GET /health for the router), read from a loaded engine.
 */
import type { EngineInfo } from '../engine/types.js';
import type { PairSettings } from '../kv/messages.js';

/**
 * PairSettings of an engine: model fingerprint, context size, batch size, flash attention, KV
 * cache type — what a saved state's validity depends on. Backend and offloaded layers are not
 * in it: a state saved on a GPU loads on a CPU and the other way round (same file format).
 */
export function pairSettingsOf(info: EngineInfo): PairSettings {
  return { fingerprint: info.fingerprint, contextSize: info.compat.contextSize, batchSize: info.compat.batchSize, flashAttention: info.compat.flashAttention, kvCacheType: info.compat.kvCacheType };
}
