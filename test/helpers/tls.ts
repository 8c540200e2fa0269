/**
 * Throwaway TLS material for tests, made with openssl at run time: a CA, a certificate it signs for
 * 127.0.0.1/localhost and any other hosts asked for (a server's and, EKU-free, a client's too),
 * and a second CA with its own certificate (a "stranger" the first CA never signed).
 */
import { execFileSync } from 'node:child_process';
import { mkdtempSync, readFileSync, writeFileSync } from 'node:fs';
import { isIP } from 'node:net';
import { tmpdir } from 'node:os';
import { join } from 'node:path';

export interface TestPki {
  dir: string;
  /** Paths of the PEM files. */
  ca: string;
  cert: string;
  key: string;
  /** A certificate and key signed by another CA. */
  strangerCert: string;
  strangerKey: string;
  /** The same, read. */
  pem: { ca: Buffer; cert: Buffer; key: Buffer; strangerCert: Buffer; strangerKey: Buffer };
  /** The hosts the certificates name (subjectAltName): 127.0.0.1, localhost and those asked for. */
  hosts: string[];
}

/**
 * Make the files in a fresh temp folder (P-256 keys, valid one day); the certificates name
 * 127.0.0.1, localhost and `hosts` (IP literals or DNS names: the addresses of the multi-host tests).
 * @throws when openssl fails.
 */
export function makeTestPki(hosts: readonly string[] = []): TestPki {
  const dir = mkdtempSync(join(tmpdir(), 'pdserve-pki-'));
  const ssl = (...args: string[]) => execFileSync('openssl', args, { cwd: dir, stdio: 'pipe' });
  const ec = ['-newkey', 'ec', '-pkeyopt', 'ec_paramgen_curve:prime256v1', '-nodes'];
  const names = [...new Set(['127.0.0.1', 'localhost', ...hosts])];
  writeFileSync(join(dir, 'san.ext'), `subjectAltName=${names.map((h) => (isIP(h) ? `IP:${h}` : `DNS:${h}`)).join(',')}\n`);
  for (const who of ['ca', 'other-ca']) ssl('req', '-x509', ...ec, '-keyout', `${who}.key`, '-out', `${who}.crt`, '-days', '1', '-subj', `/CN=pdserve test ${who}`);
  for (const [who, ca] of [['node', 'ca'], ['stranger', 'other-ca']] as const) {
    ssl('req', ...ec, '-keyout', `${who}.key`, '-out', `${who}.csr`, '-subj', '/CN=127.0.0.1');
    ssl('x509', '-req', '-in', `${who}.csr`, '-CA', `${ca}.crt`, '-CAkey', `${ca}.key`, '-CAcreateserial', '-out', `${who}.crt`, '-days', '1', '-extfile', 'san.ext');
  }
  const p = (f: string) => join(dir, f);
  return {
    dir,
    ca: p('ca.crt'),
    cert: p('node.crt'),
    key: p('node.key'),
    strangerCert: p('stranger.crt'),
    strangerKey: p('stranger.key'),
    pem: { ca: readFileSync(p('ca.crt')), cert: readFileSync(p('node.crt')), key: readFileSync(p('node.key')), strangerCert: readFileSync(p('stranger.crt')), strangerKey: readFileSync(p('stranger.key')) },
    hosts: names,
  };
}
