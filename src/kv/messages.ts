/**
 * Wire messages of the prefill↔decode channel (one TCP connection per prefill–decode pair,
 * opened by decode to prefill's bootstrap port; carries control and KV data).
 *
 * Frame: u32 BE length of (type byte + body) | u8 type | body.
 *   type 1 = control: body is UTF-8 JSON of a ControlMsg, at most MAX_CONTROL_BYTES.
 *   type 2 = KV chunk: body is u64 BE room id | u64 BE offset | data, data at most MAX_CHUNK_BYTES.
 *   Room ids travel as u64 in chunk frames, so every room id in the KV layer must be the canonical
 *   decimal form of a u64 (no leading zeros; the branded RoomId of base/room-id.ts).
 * Handshake (before anything else; any other frame first closes the connection):
 *   prefill → hello {nonce, epoch, settings}; decode → auth {nonce, epoch, mac, settings};
 *   prefill → auth_ok {mac} (or auth_fail {reason, code} and close, so decode can tell a refused
 *   secret or a settings mismatch from a dead peer). Both sides compare the PairSettings: a
 *   mismatched pair is refused with one log line on each side and never carries a room.
 *   mac = HMAC-SHA256(secret, "pdserve/v1|<direction>|<server nonce>|<client nonce>|<sender epoch>"),
 *   lowercase hex; direction is "decode>prefill" in auth (sender epoch = decode's) and
 *   "prefill>decode" in auth_ok (sender epoch = prefill's, from hello). Nonces: >= 16 random bytes,
 *   hex. Each side binds the peer's epoch to the connection; register, kv_ack and fail carry the
 *   sender's epoch and are refused unless it equals the epoch bound at auth.
 * Heartbeat: after auth both sides send ping {seq} every heartbeat interval and answer pong {seq};
 *   any received byte counts as liveness; a peer silent for 2 intervals is lost.
 */

import { isErrorCode, type RoomFailure } from '../base/errors.js';
import type { RoomId } from '../base/room-id.js';

export const FRAME_CONTROL = 1;
export const FRAME_CHUNK = 2;
/** Largest JSON control body, bytes. */
export const MAX_CONTROL_BYTES = 64 * 1024;
/** Largest KV chunk payload, bytes. */
export const MAX_CHUNK_BYTES = 1024 * 1024;
/** Most sockets one KV connection may be striped over (`--kv-streams`). */
export const MAX_KV_STREAMS = 8;

/**
 * Envelope header wrapped around a llama.cpp sequence state. The transferred blob is
 * envelope(header) + ggsq payload (see envelope.ts for the binary form); decode validates it
 * before anything reaches llama.cpp.
 */
export interface EnvelopeHeader {
  /** Envelope format version. */
  version: number;
  /** sha256 of the GGUF, hex. */
  fingerprint: string;
  contextSize: number;
  batchSize: number;
  /** Prompt tokens in the state. */
  nTokens: number;
  /** First generated token, sampled by prefill. */
  firstToken: number;
  /** Leading prompt tokens prefill took from its prefix cache (reported as usage cached_tokens); absent = 0. */
  cachedTokens?: number;
  firstIsEog: boolean;
  /** Bytes of the raw ggsq payload that follows. */
  payloadBytes: number;
  /** Algorithm of the payload checksum in the envelope's trailer ('crc32', see transfer/checksum.ts). */
  checksum: 'crc32';
}

/**
 * The settings a prefill–decode pair must share, exchanged in the handshake (hello / auth): a
 * state saved under one set cannot be loaded under another, so a mismatched pair is refused at
 * connect time instead of failing every request after prefill did all the work.
 */
export interface PairSettings {
  /** sha256 of the GGUF, hex. */
  fingerprint: string;
  /** Tokens per sequence. */
  contextSize: number;
  /** Prompt chunk, tokens (llama.cpp batchSize). */
  batchSize: number;
  /** llama.cpp flash attention (changes the V-cache layout of the saved state). */
  flashAttention: boolean;
  /** K and V cache type ('f16', 'q8_0', 'q4_0'); absent = 'f16' (a worker that does not report it). */
  kvCacheType?: string;
  /** The protocol the process speaks (`MAJOR.MINOR`, ../base/version.ts): another major never pairs; absent = 1.0. */
  protocol?: string;
  /** The process's build (`<version>+<commit>`): reported, never compared. */
  build?: string;
}

export type ControlMsg =
  /** `streams`: the most sockets this prefill stripes one connection over (`--kv-streams`; absent = 1). */
  | { type: 'hello'; nonce: string; epoch: string; role: 'prefill'; settings: PairSettings; streams?: number }
  /**
   * `streams`: decode's `--kv-streams` (absent = 1); the pair uses the smaller of the two.
   * `stripe`: this connection is socket `index` (1..streams-1) of the striped connection whose
   * hello carried nonce `of` (stripes.ts), not a connection of its own.
   */
  | { type: 'auth'; nonce: string; epoch: string; role: 'decode'; mac: string; settings: PairSettings; streams?: number; stripe?: { of: string; index: number } }
  | { type: 'auth_ok'; mac: string }
  /**
   * prefill → decode, instead of auth_ok: refused; prefill closes right after. `code`:
   * 'settings_mismatch' (the pair's PairSettings differ) or 'auth_failed'.
   */
  | { type: 'auth_fail'; reason: string; code?: 'settings_mismatch' | 'auth_failed' }
  /**
   * decode → prefill: a slot is reserved for this room; prefill may compute. `kvStream`: this
   * decode takes a streamed kv_begin (the state sent while prefill's llama.cpp still saves it,
   * its size and CRC-32 in kv_end; transfer/sender.ts `sendGrowingStateFile`). Absent (a decode
   * of an earlier version): prefill sends the saved file with the size in kv_begin, as before.
   */
  | { type: 'register'; room: RoomId; rid: string; epoch: string; kvStream?: boolean }
  /** prefill → decode: registration accepted. */
  | { type: 'registered'; room: RoomId }
  /**
   * prefill → decode: the state follows in chunk frames. `totalBytes`: the bytes that follow
   * (head + payload + CRC-32 trailer). `streamed` (only to a decode whose `register` said
   * `kvStream`): the state is sent while it is being saved, so its size is not known yet:
   * `totalBytes` is then prefill's estimate of head + payload (a hint for the destination file;
   * decode's own limit caps what it accepts), the envelope head says `payloadBytes: 0`, no
   * trailer follows the payload, and kv_end carries the real byte count and the CRC-32.
   */
  | { type: 'kv_begin'; room: RoomId; totalBytes: number; streamed?: boolean }
  /**
   * prefill → decode: all chunks sent. After a streamed kv_begin: `totalBytes` = the bytes sent
   * (head + payload) and `crc` = the payload's CRC-32 (both required then).
   */
  | { type: 'kv_end'; room: RoomId; totalBytes?: number; crc?: number }
  /** decode → prefill: state validated and loaded. */
  | { type: 'kv_ack'; room: RoomId; epoch: string }
  /**
   * decode → prefill, once per connection (transfer/same-host.ts): "are we on one host and one
   * state directory?" `boot` = this host's boot id, `pidns` = this process's pid namespace, `file`
   * = the basename of a probe file decode wrote into its state directory holding a random nonce.
   */
  | { type: 'same_host_probe'; boot: string; pidns: string; file: string }
  /** prefill → decode: the nonce prefill read from `file` in its own state directory (ok), or why not. */
  | { type: 'same_host_reply'; ok: boolean; nonce?: string; reason?: string }
  /**
   * decode → prefill: the nonce matched; prefill may hand this connection's rooms over as kv_file.
   * `verify`: decode runs --kv-same-host-verify, so every kv_file must carry the payload's CRC-32.
   * `headerWalk`: decode takes a kv_file without `crc` (it validates such a file by the header
   * walk; every decode since that default sends it). Absent (a decode of an earlier version,
   * whose kv_file schema requires `crc`): prefill sends the CRC-32 in every kv_file to it.
   */
  | { type: 'same_host_ok'; verify?: boolean; headerWalk?: boolean }
  /**
   * prefill → decode, instead of kv_begin/chunks/kv_end on a same-host connection: the saved state
   * is the file `file` (a basename in the shared state directory, see same-host.ts for the name and
   * its ownership), `payloadBytes` long; `head` is the envelope head (base64), validated as on the
   * TCP path. `crc` (the payload's CRC-32) only with --kv-same-host-verify on either side or for a
   * decode whose same_host_ok lacks `headerWalk`; without it decode checks size, head and the ggsq
   * structure but not the data bytes (same-host.ts).
   */
  | { type: 'kv_file'; room: RoomId; file: string; payloadBytes: number; crc?: number; head: string }
  /** decode → prefill: the kv_file was not taken (missing, wrong size, …): send this room over TCP. */
  | { type: 'kv_file_refused'; room: RoomId; reason: string; epoch: string }
  /**
   * either way: the room failed or was aborted on the sender's side (a RoomFailure: `code` from
   * the error table, `detail` for humans). Idempotent. Decode sends it even for a room it never
   * registered (refused at admission, prealloc deadline), opening the connection if needed.
   */
  | { type: 'fail'; room: RoomId; code: string; detail: string; epoch: string }
  | { type: 'ping'; seq: number }
  | { type: 'pong'; seq: number };

/** The control messages about one room. */
export type RoomMsg = Extract<ControlMsg, { room: RoomId }>;

/** The per-connection same-host messages (transfer/same-host.ts). */
export type SameHostMsg = Extract<ControlMsg, { type: 'same_host_probe' | 'same_host_reply' | 'same_host_ok' }>;

/** What the channel hands to onMessage: room messages and the same-host probe. */
export type PeerMsg = RoomMsg | SameHostMsg;

/**
 * The RoomFailure a received `fail` message stands for: the peer's own code (a client abort on
 * decode stays `request_aborted`, client-caused, on prefill), its detail prefixed with the peer's
 * role. An unknown code (a newer peer) becomes `internal_error`.
 */
export function failureFromWire(msg: Extract<ControlMsg, { type: 'fail' }>, peerRole: 'prefill' | 'decode'): RoomFailure {
  return { code: isErrorCode(msg.code) ? msg.code : 'internal_error', detail: `${peerRole}: ${msg.detail}` };
}
