/**
 * Mutual HMAC-SHA256 challenge-response of the prefill↔decode channel (see messages.ts):
 *
 *   prefill → hello {nonce: sN, epoch: sE}
 *   decode  → auth  {nonce: cN, epoch: cE, mac: authMac(secret, 'decode>prefill', sN, cN, cE)}
 *   prefill → auth_ok {mac: authMac(secret, 'prefill>decode', sN, cN, sE)}
 *
 * Each mac proves knowledge of the secret, is fresh (both nonces) and binds the sender's epoch
 * to this connection. Pure functions over node:crypto.
 */
import { createHmac, randomBytes, timingSafeEqual } from 'node:crypto';

/** Who sends the mac: decode in `auth`, prefill in `auth_ok`. */
export type AuthDirection = 'decode>prefill' | 'prefill>decode';

/** Protocol tag mixed into every mac. */
export const AUTH_PROTOCOL = 'pdserve/v1';

/** A fresh random nonce: 16 bytes as 32 lowercase hex chars. */
export function newNonce(): string {
  return randomBytes(16).toString('hex');
}

/** A fresh session epoch for one process start: 8 random bytes as 16 lowercase hex chars. */
export function newEpoch(): string {
  return randomBytes(8).toString('hex');
}

/** The exact string that is MACed. */
export function authInput(direction: AuthDirection, serverNonce: string, clientNonce: string, senderEpoch: string): string {
  return `${AUTH_PROTOCOL}|${direction}|${serverNonce}|${clientNonce}|${senderEpoch}`;
}

/**
 * HMAC-SHA256(secret, authInput(...)) as 64 lowercase hex chars.
 * Throws TypeError on an empty secret (an empty secret authenticates nobody).
 */
export function authMac(secret: string | Buffer, direction: AuthDirection, serverNonce: string, clientNonce: string, senderEpoch: string): string {
  if (secret.length === 0) throw new TypeError('KV channel secret must not be empty');
  return createHmac('sha256', secret).update(authInput(direction, serverNonce, clientNonce, senderEpoch), 'utf8').digest('hex');
}

/**
 * Constant-time check of a received mac (hex) against the expected one. False on any malformed
 * input (wrong length, non-hex); never throws on attacker-controlled input.
 */
export function verifyMac(secret: string | Buffer, direction: AuthDirection, serverNonce: string, clientNonce: string, senderEpoch: string, mac: unknown): boolean {
  if (typeof mac !== 'string' || !/^[0-9a-f]{64}$/.test(mac)) return false;
  const want = Buffer.from(authMac(secret, direction, serverNonce, clientNonce, senderEpoch), 'hex');
  const got = Buffer.from(mac, 'hex');
  return got.length === want.length && timingSafeEqual(got, want);
}
