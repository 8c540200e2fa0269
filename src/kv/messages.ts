/**
 * Wire messages of the prefill↔decode channel (one TCP connection per prefill–decode pair,
 * opened by decode to prefill's bootstrap port; carries control and KV data).
 *
 * Frame: u32 BE length of (type byte + body) | u8 type | body.
 *   type 1 = control: body is UTF-8 JSON of a ControlMsg, at most MAX_CONTROL_BYTES.
 *   type 2 = KV chunk: body is u64 BE room id | u64 BE offset | data, data at most MAX_CHUNK_BYTES.
 *   Room ids travel as u64 in chunk frames, so every room id in the KV layer must be the canonical
 *   decimal form of a u64 (no leading zeros; see normalizeRoomId in frame.ts).
 * Handshake (before anything else; any other frame first closes the connection):
 *   prefill → hello {nonce, epoch}; decode → auth {nonce, epoch, mac}; prefill → auth_ok {mac}
 *   (or auth_fail {reason} and close, so decode can tell a refused secret from a dead peer).
 *   mac = HMAC-SHA256(secret, "pdserve/v1|<direction>|<server nonce>|<client nonce>|<sender epoch>"),
 *   lowercase hex; direction is "decode>prefill" in auth (sender epoch = decode's) and
 *   "prefill>decode" in auth_ok (sender epoch = prefill's, from hello). Nonces: >= 16 random bytes,
 *   hex. Each side binds the peer's epoch to the connection; register, kv_ack and fail carry the
 *   sender's epoch and are refused unless it equals the epoch bound at auth.
 * Heartbeat: after auth both sides send ping {seq} every heartbeat interval and answer pong {seq};
 *   any received byte counts as liveness; a peer silent for 2 intervals is lost.
 */

export const FRAME_CONTROL = 1;
export const FRAME_CHUNK = 2;
/** Largest JSON control body, bytes. */
export const MAX_CONTROL_BYTES = 64 * 1024;
/** Largest KV chunk payload, bytes. */
export const MAX_CHUNK_BYTES = 1024 * 1024;

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
  /** sha256 of the payload, hex. */
  checksum: string;
}

export type ControlMsg =
  | { type: 'hello'; nonce: string; epoch: string; role: 'prefill' }
  | { type: 'auth'; nonce: string; epoch: string; role: 'decode'; mac: string }
  | { type: 'auth_ok'; mac: string }
  /** prefill → decode, instead of auth_ok: authentication refused; prefill closes right after. */
  | { type: 'auth_fail'; reason: string }
  /** decode → prefill: a slot is reserved for this room; prefill may compute. */
  | { type: 'register'; room: string; rid: string; epoch: string }
  /** prefill → decode: registration accepted. */
  | { type: 'registered'; room: string }
  /** prefill → decode: the state follows in chunk frames. */
  | { type: 'kv_begin'; room: string; totalBytes: number }
  /** prefill → decode: all chunks sent. */
  | { type: 'kv_end'; room: string }
  /** decode → prefill: state validated and loaded. */
  | { type: 'kv_ack'; room: string; epoch: string }
  /** either way: the room failed or was aborted on the sender's side. Idempotent. */
  | { type: 'fail'; room: string; reason: string; epoch: string }
  | { type: 'ping'; seq: number }
  | { type: 'pong'; seq: number };

/** The control messages about one room: the only ones handed to the channel's onMessage. */
export type RoomMsg = Extract<ControlMsg, { room: string }>;
