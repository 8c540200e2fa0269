/**
 * The KV channel handshake as a sans-IO state machine (no socket, no timer): it consumes the
 * handshake control messages and says what to send and how it ended. `connection.ts` feeds it;
 * unit tests drive it directly. Wire format: messages.ts; MACs: auth.ts.
 *
 *   prefill → hello {nonce sN, epoch sE, settings}
 *   decode  → auth  {nonce cN, epoch cE, mac, settings}
 *   prefill → auth_ok {mac}  |  auth_fail {reason, code}
 *
 * Besides mutual authentication, both sides compare the pair's `PairSettings` (model
 * fingerprint, context size, batch size, flash attention, KV cache type): a state saved under one set cannot be
 * loaded under another, so a mismatched pair is refused here — before any room uses it — with
 * code 'settings_mismatch', instead of failing every request after prefill did all the work.
 */
import { authMac, newNonce, verifyMac } from './auth.js';
import type { ControlMsg, PairSettings } from './messages.js';
import { peerProtocol, protocolMismatch } from '../base/version.js';

/**
 * What differs between two PairSettings, as one human line ("contextSize 2048 ≠ 4096; …"), or
 * undefined when they match. `a` is the local side's.
 */
export function settingsMismatch(a: PairSettings, b: PairSettings): string | undefined {
  const diffs: string[] = [];
  if (a.fingerprint !== b.fingerprint) diffs.push(`model fingerprint ${a.fingerprint.slice(0, 12)}… ≠ ${b.fingerprint.slice(0, 12)}…`);
  if (a.contextSize !== b.contextSize) diffs.push(`contextSize ${a.contextSize} ≠ ${b.contextSize}`);
  if (a.batchSize !== b.batchSize) diffs.push(`batchSize ${a.batchSize} ≠ ${b.batchSize}`);
  if (a.flashAttention !== b.flashAttention) diffs.push(`flashAttention ${a.flashAttention} ≠ ${b.flashAttention}`);
  if ((a.kvCacheType ?? 'f16') !== (b.kvCacheType ?? 'f16')) diffs.push(`kvCacheType ${a.kvCacheType ?? 'f16'} ≠ ${b.kvCacheType ?? 'f16'}`);
  const protocol = protocolMismatch(peerProtocol(a.protocol), peerProtocol(b.protocol));
  if (protocol) diffs.push(`${protocol}${a.build || b.build ? `, builds ${a.build ?? '?'} and ${b.build ?? '?'}` : ''}`);
  return diffs.length ? diffs.join('; ') : undefined;
}

/** How a handshake step ended. */
export type HandshakeStep =
  /** Keep going: send these (possibly none) and wait for the next message. */
  | { k: 'continue'; send: ControlMsg[] }
  /** Authenticated: send these, then the connection is open with the peer's epoch. */
  | {
      k: 'open';
      send: ControlMsg[];
      peerEpoch: string;
      peerSettings: PairSettings;
      /** Sockets the pair stripes one connection over: the smaller of both sides' `streams`. */
      streams: number;
      /** Prefill only: decode asked this connection to join a striped one (see HandshakeOptions.stripe). */
      stripe?: { of: string; index: number };
    }
  /**
   * Refused. `send` (prefill only: auth_fail) goes out before closing; `code` says why:
   * 'AUTH_FAILED' (bad mac, wrong message, refused by prefill) or 'SETTINGS_MISMATCH'.
   */
  | { k: 'refuse'; send: ControlMsg[]; code: 'AUTH_FAILED' | 'SETTINGS_MISMATCH'; reason: string };

export interface HandshakeOptions {
  side: 'prefill' | 'decode';
  secret: string | Buffer;
  /** This process's epoch. */
  epoch: string;
  /** This process's pair settings. */
  settings: PairSettings;
  /** The most sockets this side stripes one connection over (default 1). */
  streams?: number;
  /** Decode only: this connection joins the striped connection whose hello nonce is `of`, as socket `index`. */
  stripe?: { of: string; index: number };
}

/** One connection's handshake. Feed every control message received before `open` to `onMessage`. */
export class Handshake {
  private serverNonce = '';
  private clientNonce = '';
  private helloEpoch = '';
  private helloSettings: PairSettings | undefined;
  private helloStreams = 1;

  constructor(private readonly o: HandshakeOptions) {}

  /** Messages to send as soon as the TCP connection exists (prefill: hello; decode: none). */
  start(): ControlMsg[] {
    if (this.o.side !== 'prefill') return [];
    this.serverNonce = newNonce();
    const streams = this.o.streams ?? 1;
    return [{ type: 'hello', nonce: this.serverNonce, epoch: this.o.epoch, role: 'prefill', settings: this.o.settings, ...(streams > 1 ? { streams } : {}) }];
  }

  /** The prefill's hello nonce of this connection (the key a stripe names in `auth.stripe.of`); '' before hello. */
  get helloNonce(): string {
    return this.serverNonce;
  }

  /** One received control message. */
  onMessage(msg: ControlMsg): HandshakeStep {
    return this.o.side === 'prefill' ? this.onPrefill(msg) : this.onDecode(msg);
  }

  private onPrefill(msg: ControlMsg): HandshakeStep {
    const { secret, epoch, settings } = this.o;
    if (msg.type !== 'auth') return this.refuseAuth(`unauthenticated '${msg.type}' frame before auth`);
    if (!verifyMac(secret, 'decode>prefill', this.serverNonce, msg.nonce, msg.epoch, msg.mac)) return this.refuseAuth('authentication failed: bad mac (wrong secret?)');
    const diff = settingsMismatch(settings, msg.settings);
    if (diff !== undefined) {
      const reason = `settings mismatch (prefill ≠ decode): ${diff}`;
      return { k: 'refuse', code: 'SETTINGS_MISMATCH', reason, send: [{ type: 'auth_fail', reason, code: 'settings_mismatch' }] };
    }
    this.clientNonce = msg.nonce;
    const mac = authMac(secret, 'prefill>decode', this.serverNonce, this.clientNonce, epoch);
    const streams = Math.min(this.o.streams ?? 1, msg.streams ?? 1);
    return { k: 'open', send: [{ type: 'auth_ok', mac }], peerEpoch: msg.epoch, peerSettings: msg.settings, streams, ...(msg.stripe ? { stripe: msg.stripe } : {}) };
  }

  private onDecode(msg: ControlMsg): HandshakeStep {
    const { secret, epoch, settings } = this.o;
    if (!this.serverNonce) {
      if (msg.type !== 'hello') return { k: 'refuse', code: 'AUTH_FAILED', reason: `expected hello from prefill, got '${msg.type}'`, send: [] };
      this.serverNonce = msg.nonce;
      this.helloEpoch = msg.epoch;
      this.helloSettings = msg.settings;
      this.helloStreams = msg.streams ?? 1;
      this.clientNonce = newNonce();
      const streams = this.o.streams ?? 1;
      const extra = { ...(streams > 1 ? { streams } : {}), ...(this.o.stripe ? { stripe: this.o.stripe } : {}) };
      // Even when the settings differ, authenticate: prefill then refuses with auth_fail
      // (settings_mismatch), so both sides log the refusal.
      return { k: 'continue', send: [{ type: 'auth', nonce: this.clientNonce, epoch, role: 'decode', mac: authMac(secret, 'decode>prefill', this.serverNonce, this.clientNonce, epoch), settings, ...extra }] };
    }
    if (msg.type === 'auth_fail') {
      if (msg.code === 'settings_mismatch') {
        const diff = this.helloSettings ? settingsMismatch(settings, this.helloSettings) : undefined;
        return { k: 'refuse', code: 'SETTINGS_MISMATCH', reason: `settings mismatch (decode ≠ prefill): ${diff ?? msg.reason}`, send: [] };
      }
      return { k: 'refuse', code: 'AUTH_FAILED', reason: `prefill refused authentication: ${msg.reason}`, send: [] };
    }
    if (msg.type !== 'auth_ok') return { k: 'refuse', code: 'AUTH_FAILED', reason: `expected auth_ok from prefill, got '${msg.type}'`, send: [] };
    if (!verifyMac(secret, 'prefill>decode', this.serverNonce, this.clientNonce, this.helloEpoch, msg.mac)) {
      return { k: 'refuse', code: 'AUTH_FAILED', reason: 'prefill failed to authenticate: bad mac (wrong secret?)', send: [] };
    }
    return { k: 'open', send: [], peerEpoch: this.helloEpoch, peerSettings: this.helloSettings!, streams: Math.min(this.o.streams ?? 1, this.helloStreams) };
  }

  private refuseAuth(reason: string): HandshakeStep {
    return { k: 'refuse', code: 'AUTH_FAILED', reason, send: [{ type: 'auth_fail', reason, code: 'auth_failed' }] };
  }
}
