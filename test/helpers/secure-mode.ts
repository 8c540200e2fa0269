/**
 * Secure test mode (`PDSERVE_TEST_SECURE=1`, docs/TESTING.md): every cluster the harness starts
 * (./stack.ts) without access or TLS options of its own is handed this kit as its `lock`
 * (src/up/cluster.ts `ClusterLock`): an API key, an admin key, client TLS on the router and the
 * colocated server, and internal mutual TLS between the roles, from one throwaway CA made with
 * openssl per test process (./tls.ts). The test clients (`Cluster.start`'s
 * process-wide dispatcher, the openai SDK helpers, the CLI helper) send the keys and trust the CA,
 * so a test written for an open cluster runs unchanged against a locked one.
 */
import { rmSync } from 'node:fs';
import { randomBytes } from 'node:crypto';
import { accessClassOf } from '../../src/api/access.js';
import type { ClusterLock } from '../../src/up/cluster.js';
import { makeTestPki, type TestPki } from './tls.js';

/** The environment variable that turns secure test mode on ('1'). */
export const SECURE_TEST_ENV = 'PDSERVE_TEST_SECURE';

/** The keys and PEM files of secure test mode (one set per process). */
export interface SecureKit extends ClusterLock {
  apiKey: string;
  adminKey: string;
  pki: TestPki;
  /** The key a request to the router or colocated server sends: the admin key on /workers, /debug/*, /dashboard and /metrics, else the API key. */
  keyFor(path: string): string;
  /** `pdserve doctor` flags that trust the CA and present the internal client certificate. */
  doctorArgs: string[];
  /** Environment of a CLI child: the admin key (doctor, storm). */
  env: Record<string, string>;
}

let kit: SecureKit | undefined;

/** True when `PDSERVE_TEST_SECURE=1`. */
export function secureTestMode(): boolean {
  return process.env[SECURE_TEST_ENV] === '1';
}

/**
 * The process's secure-mode kit, made on first use (openssl: a CA and a certificate for
 * 127.0.0.1, localhost and `hosts`, valid one day; removed when the process exits). `hosts`:
 * the other addresses the cluster binds (`ClusterOptions.placement`), which the certificate
 * must name for a peer to verify it.
 * @throws when openssl fails, or when the kit exists and does not name one of `hosts` (its CA is
 * shared by every cluster of the process: start the cluster with the most hosts first).
 */
export function secureKit(hosts: readonly string[] = []): SecureKit {
  if (kit) {
    const missing = hosts.filter((h) => !kit!.pki.hosts.includes(h));
    if (missing.length) throw new Error(`secure test mode: this process's certificate names ${kit.pki.hosts.join(', ')}, not ${missing.join(', ')}`);
    return kit;
  }
  const pki = makeTestPki(hosts);
  process.once('exit', () => rmSync(pki.dir, { recursive: true, force: true }));
  const apiKey = `sk-test-${randomBytes(12).toString('hex')}`;
  const adminKey = `sk-admin-${randomBytes(12).toString('hex')}`;
  kit = {
    apiKey,
    adminKey,
    pki,
    keyFor: (path) => (['admin', 'metrics'].includes(accessClassOf('GET', path)) ? adminKey : apiKey),
    doctorArgs: ['--ca', pki.ca, '--internal-tls-ca', pki.ca, '--internal-tls-cert', pki.cert, '--internal-tls-key', pki.key],
    env: { PDSERVE_ADMIN_API_KEY: adminKey },
  };
  return kit;
}
