/**
 * The settings a prefill–decode pair must share (`PairSettings`, exchanged in the KV handshake
 * and shown on GET /health for the router), read from a loaded engine.
 */
import type { EngineInfo } from '../engine/types.js';
import type { PairSettings } from '../kv/messages.js';
import { BUILD, protocolVersion } from '../base/version.js';

/**
 * PairSettings of an engine: model fingerprint, context size, batch size, flash attention, KV
 * cache type — what a saved state's validity depends on — and the process's protocol (another
 * major never pairs) and build (shown only). Backend and offloaded layers are not
 * in it: a state saved on a GPU loads on a CPU and the other way round (same file format).
 */
export function pairSettingsOf(info: EngineInfo): PairSettings {
  return { fingerprint: info.fingerprint, contextSize: info.compat.contextSize, batchSize: info.compat.batchSize, flashAttention: info.compat.flashAttention, kvCacheType: info.compat.kvCacheType, protocol: protocolVersion(), build: BUILD.id };
}
