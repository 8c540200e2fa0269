/**
 * TLS material of a listening server (node:tls options for fastify's `https`): `--tls-cert` and
 * `--tls-key` (PEM files), read once at start.
 */
import { readFileSync } from 'node:fs';

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
      throw new Error(`cannot read the TLS ${what} ${p}: ${(err as Error).message}`);
    }
  };
  return { cert: read('certificate', t.cert), key: read('key', t.key) };
}
