/**
 * TLS material of a listening server (node:tls options for fastify's `https`): `--tls-cert` and
 * `--tls-key` (PEM files), read once at start.
 */
import { readFileSync } from 'node:fs';
import { ConfigError } from '../base/errors.js';

/** Paths of a PEM certificate (chain) and its private key. */
export interface TlsFiles {
  cert: string;
  key: string;
}

/**
 * Read the PEM files into server options.
 * @throws Error naming the file that cannot be read.
 */
export function tlsServerOptions(t: TlsFiles): { cert: Buffer; key: Buffer } {
  const read = (what: string, p: string): Buffer => {
    try {
      return readFileSync(p);
    } catch (err) {
      throw new ConfigError(`cannot read the TLS ${what} ${p}: ${(err as Error).message}`);
    }
  };
  return { cert: read('certificate', t.cert), key: read('key', t.key) };
}

/**
 * Paths of the internal TLS material (`--internal-tls-cert`, `--internal-tls-key`,
 * `--internal-tls-ca`, PEM): this process's certificate and key (served to its clients, and
 * presented as the client certificate when it calls another role), and the CA that signs the
 * cluster's certificates (verifies the servers it calls; on a server, a client must present a
 * certificate it signed: mutual TLS).
 */
export interface InternalTlsFiles {
  cert?: string;
  key?: string;
  ca?: string;
}

/** The internal TLS material, read. */
export interface InternalTls {
  cert?: Buffer;
  key?: Buffer;
  ca?: Buffer;
}

/**
 * Read the internal TLS files.
 * @returns undefined when no file is named.
 * @throws Error when only one of cert and key is named, or naming a file that cannot be read.
 */
export function loadInternalTls(f: InternalTlsFiles | undefined): InternalTls | undefined {
  if (!f || (!f.cert && !f.key && !f.ca)) return undefined;
  if (!f.cert !== !f.key) throw new ConfigError('--internal-tls-cert and --internal-tls-key go together');
  const read = (what: string, p: string): Buffer => {
    try {
      return readFileSync(p);
    } catch (err) {
      throw new ConfigError(`cannot read the internal TLS ${what} ${p}: ${(err as Error).message}`);
    }
  };
  return { ...(f.cert ? { cert: read('certificate', f.cert) } : {}), ...(f.key ? { key: read('key', f.key) } : {}), ...(f.ca ? { ca: read('CA', f.ca) } : {}) };
}

/**
 * node:tls server options of a worker's HTTP server and KV listener: its certificate and key;
 * with a CA, every client must present a certificate that CA signed (mutual TLS: a client
 * without one is refused in the handshake, before any byte of HTTP or KV is read).
 * @throws Error when the certificate or key is missing (a server needs both).
 */
export function internalServerOptions(t: InternalTls): { cert: Buffer; key: Buffer; ca?: Buffer; requestCert: boolean; rejectUnauthorized: boolean } {
  if (!t.cert || !t.key) throw new ConfigError('internal TLS on a server needs --internal-tls-cert and --internal-tls-key');
  return { cert: t.cert, key: t.key, ...(t.ca ? { ca: t.ca } : {}), requestCert: t.ca !== undefined, rejectUnauthorized: t.ca !== undefined };
}

/**
 * node:tls client options (undici's `connect`, `tls.connect`) of a call to another role: the CA
 * that verifies the server (default: the system store) and the client certificate, when given.
 */
export function internalClientOptions(t: InternalTls): { ca?: Buffer; cert?: Buffer; key?: Buffer } {
  return { ...(t.ca ? { ca: t.ca } : {}), ...(t.cert && t.key ? { cert: t.cert, key: t.key } : {}) };
}

/** The files as `--internal-tls-*` flags of a child process (paths only: no secret). */
export function internalTlsArgs(f: InternalTlsFiles | undefined): string[] {
  if (!f) return [];
  return [...(f.cert ? ['--internal-tls-cert', f.cert] : []), ...(f.key ? ['--internal-tls-key', f.key] : []), ...(f.ca ? ['--internal-tls-ca', f.ca] : [])];
}
