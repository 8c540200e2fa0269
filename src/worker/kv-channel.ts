/**
 * The KV channel options both worker roles start their end of the channel with (prefill's
 * `KvServer`, decode's `KvPeerPool`), built in one place from the role's config, engine and
 * identity: the transport (TLS with --internal-tls-*, else TCP), the cluster secret, this
 * process's epoch and pair settings, the heartbeat and the clock that times it, the sockets a
 * connection's chunks may be striped over (`--kv-streams`).
 */
import type { Clock } from '../base/clock.js';
import type { Logger } from '../base/log.js';
import { pairSettingsOf } from '../protocol/pair.js';
import { loadInternalTls, type InternalTls, type InternalTlsFiles } from '../security/tls.js';
import type { Engine } from '../engine/types.js';
import type { KvChannelOptions } from '../kv/channel.js';
import { kvTransportOf } from '../kv/transport.js';

/** The channel options every handler-free end shares. */
export type KvChannelBase = Omit<KvChannelOptions, 'onMessage' | 'onChunk' | 'onPeerLost' | 'onConnect'>;

/**
 * Load the internal TLS files (once: the HTTP edge serves with the same certificate) and build
 * the channel options of a worker role.
 * @throws Error when the internal TLS files are incomplete or unreadable (`loadInternalTls`).
 */
export function workerKvChannel(
  config: { internalTls?: InternalTlsFiles | undefined; secret: string; heartbeatMs: number; kvStreams: number },
  o: { engine: Pick<Engine, 'info'>; epoch: string; clock: Clock; log: Logger },
): { internalTls: InternalTls | undefined; channel: KvChannelBase } {
  const internalTls = loadInternalTls(config.internalTls);
  return {
    internalTls,
    channel: {
      transport: kvTransportOf(internalTls),
      clock: o.clock,
      secret: config.secret,
      epoch: o.epoch,
      settings: pairSettingsOf(o.engine.info),
      heartbeatMs: config.heartbeatMs,
      streams: config.kvStreams,
      log: o.log.child({ part: 'kv' }),
    },
  };
}
