import assert from 'node:assert/strict';
import { spawn, type ChildProcess } from 'node:child_process';
import { createHash, randomBytes } from 'node:crypto';
import net from 'node:net';
import { once } from 'node:events';
import { createInterface } from 'node:readline';
import { afterEach, describe, it } from 'node:test';
import { fileURLToPath } from 'node:url';
import { authMac, newEpoch, newNonce } from '../../src/kv/auth.js';
import { KvPeerPool, KvServer, type ChunkSource, type KvChannelOptions, type KvLog, type PeerConn } from '../../src/kv/channel.js';
import { READ_TURN_BYTES, SEND_QUANTUM_BYTES } from '../../src/kv/connection.js';
import { encodeChunk, encodeControl, FrameDecoder, type Frame } from '../../src/kv/frame.js';
import { MAX_CHUNK_BYTES, type ControlMsg, type RoomMsg } from '../../src/kv/messages.js';
import { KvError } from '../../src/kv/types.js';
import { tlsTransport } from '../../src/kv/transport.js';
import { makeTestPki } from '../helpers/tls.js';

/** Pair settings both ends of these tests share (the handshake compares them). */
const PAIR = { fingerprint: 'ab'.repeat(32), contextSize: 1024, batchSize: 128, flashAttention: true };
const SECRET = 'test-secret';
const CHILD = fileURLToPath(new URL('../fixtures/kv-peer-child.ts', import.meta.url));

type Entry = { level: string; obj: Record<string, unknown>; msg?: string };
function memLog(): KvLog & { entries: Entry[]; has(re: RegExp): boolean } {
  const entries: Entry[] = [];
  const at = (level: string) => (obj: object, msg?: string) => void entries.push({ level, obj: obj as Record<string, unknown>, msg });
  return {
    entries,
    info: at('info'),
    warn: at('warn'),
    error: at('error'),
    debug: at('debug'),
    has: (re) => entries.some((e) => re.test(`${e.msg} ${JSON.stringify(e.obj)}`)),
  };
}

const cleanups: (() => unknown)[] = [];
afterEach(async () => {
  while (cleanups.length) await cleanups.pop()!();
});

async function startServer(o: Partial<KvChannelOptions> & { port?: number } = {}) {
  const log = memLog();
  const got: { conn: PeerConn; msg: RoomMsg }[] = [];
  const lost: { conn: PeerConn; reason: string }[] = [];
  const epoch = o.epoch ?? newEpoch();
  const server = new KvServer({
    host: '127.0.0.1',
    port: 0,
    secret: SECRET,
    settings: PAIR,
    log,
    onMessage: (conn, msg) => got.push({ conn, msg }),
    onPeerLost: (conn, reason) => lost.push({ conn, reason }),
    ...o,
    epoch,
  });
  const port = await server.listen();
  cleanups.push(() => server.destroy());
  return { server, port, log, got, lost, epoch };
}

function startPool(o: Partial<KvChannelOptions> & { connectTimeoutMs?: number } = {}) {
  const log = memLog();
  const got: { conn: PeerConn; msg: RoomMsg }[] = [];
  const lost: { conn: PeerConn; reason: string }[] = [];
  const epoch = o.epoch ?? newEpoch();
  const pool = new KvPeerPool({
    secret: SECRET,
    settings: PAIR,
    log,
    onMessage: (conn, msg) => got.push({ conn, msg }),
    onPeerLost: (conn, reason) => lost.push({ conn, reason }),
    ...o,
    epoch,
  });
  cleanups.push(() => pool.destroy());
  return { pool, log, got, lost, epoch };
}

async function until(cond: () => boolean, ms = 3000, what = 'condition'): Promise<void> {
  const end = Date.now() + ms;
  while (!cond()) {
    if (Date.now() > end) throw new Error(`timed out waiting for ${what}`);
    await new Promise((r) => setTimeout(r, 5));
  }
}

async function rejectsKv(p: Promise<unknown>, code: KvError['code'], re?: RegExp): Promise<KvError> {
  let err: unknown;
  await p.then(
    () => assert.fail(`expected KvError ${code}, got success`),
    (e) => (err = e),
  );
  assert.ok(err instanceof KvError, `expected KvError ${code}, got ${String(err)}`);
  assert.equal(err.code, code, err.message);
  if (re) assert.match(err.message, re);
  return err;
}

/** A hand-driven client socket speaking the wire protocol. */
class RawPeer {
  readonly frames: Frame[] = [];
  readonly dec = new FrameDecoder();
  closed = false;
  error: unknown;
  constructor(readonly sock: net.Socket) {
    sock.on('data', (b) => {
      try {
        for (const f of this.dec.feed(b)) this.frames.push(f);
      } catch (e) {
        this.error = e;
      }
    });
    sock.on('close', () => (this.closed = true));
    sock.on('error', () => {});
    cleanups.push(() => sock.destroy());
  }
  static async connect(port: number): Promise<RawPeer> {
    const sock = net.connect({ host: '127.0.0.1', port });
    await once(sock, 'connect');
    return new RawPeer(sock);
  }
  async next(type?: ControlMsg['type']): Promise<ControlMsg> {
    await until(() => this.frames.some((f) => f.kind === 'control' && (!type || f.msg.type === type)), 3000, `frame ${type}`);
    const i = this.frames.findIndex((f) => f.kind === 'control' && (!type || f.msg.type === type));
    const f = this.frames.splice(i, 1)[0];
    return (f as { msg: ControlMsg }).msg;
  }
  send(b: Buffer | Buffer[]): void {
    this.sock.write(Array.isArray(b) ? Buffer.concat(b) : b);
  }
  /** Runs the decode side of the handshake; returns prefill's epoch. */
  static async authed(port: number, epoch = newEpoch()): Promise<{ raw: RawPeer; epoch: string; serverEpoch: string }> {
    const raw = await RawPeer.connect(port);
    const hello = await raw.next('hello');
    assert.ok(hello.type === 'hello');
    const cN = newNonce();
    raw.send(encodeControl({ type: 'auth', nonce: cN, epoch, role: 'decode', mac: authMac(SECRET, 'decode>prefill', hello.nonce, cN, epoch), settings: PAIR }));
    const ok = await raw.next('auth_ok');
    assert.ok(ok.type === 'auth_ok' && ok.mac === authMac(SECRET, 'prefill>decode', hello.nonce, cN, hello.epoch));
    return { raw, epoch, serverEpoch: hello.epoch };
  }
}

function spawnChild(args: string[]): Promise<{ child: ChildProcess; first: Record<string, unknown> }> {
  const child = spawn(process.execPath, ['--import', 'tsx', CHILD, ...args], { stdio: ['ignore', 'pipe', 'inherit'] });
  cleanups.push(() => {
    if (child.exitCode === null && child.signalCode === null) {
      child.kill('SIGCONT');
      child.kill('SIGKILL');
    }
  });
  const rl = createInterface({ input: child.stdout! });
  return new Promise((resolve, reject) => {
    const t = setTimeout(() => reject(new Error('child did not start')), 20_000);
    rl.once('line', (line) => {
      clearTimeout(t);
      resolve({ child, first: JSON.parse(line) });
    });
    child.once('exit', (code) => reject(new Error(`child exited early with ${code}`)));
  });
}

/**
 * Counts event-loop turns with a chain of setImmediate callbacks (one per turn: an immediate
 * queued from an immediate runs on the next turn). `sample`, when given, is read at every turn;
 * `maxStep` is its largest rise between two turns. Counts turns, not time, so a loaded machine
 * that runs the loop late gives the same figures; a loop held in one callback gives no turns.
 */
function turnWatch(sample: () => number = () => 0): { stop(): { turns: number; maxStep: number } } {
  let turns = 0;
  let maxStep = 0;
  let last = sample();
  let running = true;
  const tick = (): void => {
    if (!running) return;
    turns++;
    const v = sample();
    maxStep = Math.max(maxStep, v - last);
    last = v;
    setImmediate(tick);
  };
  setImmediate(tick);
  return {
    stop: () => {
      running = false;
      const v = sample();
      maxStep = Math.max(maxStep, v - last);
      return { turns, maxStep };
    },
  };
}

describe('channel: authentication', () => {
  it('authenticates both ways, binds epochs, shares one connection, carries room messages', async () => {
    const s = await startServer();
    const connected: PeerConn[] = [];
    s.server.onConnect = (c) => connected.push(c);
    const p = startPool();
    const [a, b, c] = await Promise.all([p.pool.get('127.0.0.1', s.port), p.pool.get('127.0.0.1', s.port), p.pool.get('127.0.0.1', s.port)]);
    assert.equal(a, b);
    assert.equal(a, c);
    assert.equal(await p.pool.get('127.0.0.1', s.port), a, 'reused');
    assert.equal(a.peerEpoch, s.epoch);
    assert.equal(a.id, `prefill@127.0.0.1:${s.port}#${s.epoch.slice(0, 8)}`);
    await until(() => connected.length === 1);
    const sc = connected[0];
    assert.equal(sc.peerEpoch, p.epoch);
    assert.match(sc.id, new RegExp(`^decode@127\\.0\\.0\\.1:\\d+#${p.epoch.slice(0, 8)}$`));
    assert.equal(s.server.get(sc.id), sc);
    assert.deepEqual(s.server.connections(), [sc]);

    assert.ok(a.sendControl({ type: 'register', room: '12345678901234567890', rid: 'r1', epoch: p.epoch }));
    await until(() => s.got.length === 1);
    assert.deepEqual(s.got[0].msg, { type: 'register', room: '12345678901234567890', rid: 'r1', epoch: p.epoch });
    assert.equal(s.got[0].conn, sc);
    assert.ok(sc.sendControl({ type: 'registered', room: '12345678901234567890' }));
    await until(() => p.got.length === 1);
    assert.deepEqual(p.got[0].msg, { type: 'registered', room: '12345678901234567890' });
    assert.equal(s.server.stats.authFailures + p.pool.stats.authFailures, 0);
    assert.ok(s.server.stats.framesIn >= 2 && p.pool.stats.framesIn >= 3 && s.server.stats.bytesOut > 0);
  });

  it('a decode with the wrong secret is refused', async () => {
    const s = await startServer();
    const p = startPool({ secret: 'wrong' });
    await rejectsKv(p.pool.get('127.0.0.1', s.port), 'AUTH_FAILED', /prefill refused authentication: .*bad mac/);
    assert.equal(s.server.stats.authFailures, 1);
    assert.equal(p.pool.stats.authFailures, 1);
    assert.ok(s.log.has(/bad mac/));
    assert.equal(s.lost.length, 0, 'no onPeerLost for a connection that never authenticated');
    assert.equal(s.server.connections().length, 0);
  });

  it('a pair whose settings differ is refused in the handshake, one log line on each side, and not redialed', async () => {
    const s = await startServer();
    const p = startPool({ settings: { ...PAIR, contextSize: 2048, flashAttention: false } });
    await rejectsKv(p.pool.get('127.0.0.1', s.port), 'SETTINGS_MISMATCH', /settings mismatch .*contextSize 2048 ≠ 1024.*flashAttention false ≠ true/);
    await until(() => s.server.stats.settingsMismatch === 1);
    assert.equal(p.pool.stats.settingsMismatch, 1);
    assert.equal(s.server.stats.authFailures + p.pool.stats.authFailures, 0, 'a mismatch is not an authentication failure');
    const lines = (l: typeof s.log) => l.entries.filter((e) => /settings/.test(`${e.msg} ${JSON.stringify(e.obj)}`));
    assert.equal(lines(s.log).length, 1, `one line on prefill: ${JSON.stringify(lines(s.log))}`);
    assert.equal(lines(p.log).length, 1, `one line on decode: ${JSON.stringify(lines(p.log))}`);
    assert.match(JSON.stringify(lines(s.log)[0]), /contextSize 1024 ≠ 2048/);
    assert.equal(s.server.connections().length, 0);
    // The pool remembers the refusal: the next get fails at once without dialing again.
    await rejectsKv(p.pool.get('127.0.0.1', s.port), 'SETTINGS_MISMATCH', /settings mismatch/);
    assert.equal(s.server.stats.settingsMismatch, 1, 'not redialed');
    assert.equal(lines(p.log).length, 1);
  });

  it('a prefill that cannot prove the secret is refused', async () => {
    // An impostor: says hello, accepts any auth, answers with a mac made from another secret.
    const srv = net.createServer((sock) => {
      const dec = new FrameDecoder();
      const sN = newNonce();
      sock.on('error', () => {});
      sock.write(encodeControl({ type: 'hello', nonce: sN, epoch: 'deadbeefdeadbeef', role: 'prefill', settings: PAIR }));
      sock.on('data', (b) => {
        for (const f of dec.feed(b)) {
          if (f.kind === 'control' && f.msg.type === 'auth') {
            sock.write(encodeControl({ type: 'auth_ok', mac: authMac('guess', 'prefill>decode', sN, f.msg.nonce, 'deadbeefdeadbeef') }));
          }
        }
      });
    });
    srv.listen(0, '127.0.0.1');
    await once(srv, 'listening');
    cleanups.push(() => srv.close());
    const p = startPool();
    await rejectsKv(p.pool.get('127.0.0.1', (srv.address() as net.AddressInfo).port), 'AUTH_FAILED', /prefill failed to authenticate: bad mac/);
    assert.equal(p.pool.stats.authFailures, 1);
    assert.ok(p.log.has(/bad mac/));
  });

  it('a prefill that never completes the handshake hits the auth deadline', async () => {
    const srv = net.createServer((sock) => sock.on('error', () => {}));
    srv.listen(0, '127.0.0.1');
    await once(srv, 'listening');
    cleanups.push(() => srv.close());
    const p = startPool({ authTimeoutMs: 200 });
    const t0 = Date.now();
    await rejectsKv(p.pool.get('127.0.0.1', (srv.address() as net.AddressInfo).port), 'TIMEOUT', /authentication timed out after 200 ms/);
    assert.ok(Date.now() - t0 < 1000);
  });

  it('an unauthenticated frame before auth closes the connection', async () => {
    const s = await startServer();
    const raw = await RawPeer.connect(s.port);
    await raw.next('hello');
    raw.send(encodeControl({ type: 'register', room: '1', rid: 'r', epoch: newEpoch() }));
    const m = await raw.next('auth_fail');
    assert.ok(m.type === 'auth_fail' && /unauthenticated 'register' frame before auth/.test(m.reason));
    await until(() => raw.closed);
    assert.equal(s.got.length, 0);
    assert.equal(s.server.stats.authFailures, 1);
    assert.ok(s.log.has(/unauthenticated 'register' frame before auth/));

    const raw2 = await RawPeer.connect(s.port);
    await raw2.next('hello');
    raw2.send(encodeChunk('1', 0, Buffer.from('sneaky')));
    await until(() => raw2.closed);
    assert.equal(s.server.stats.badFrames, 1);
    assert.ok(s.log.has(/chunk frame not allowed/));
  });

  it('a silent client is dropped at the auth deadline', async () => {
    const s = await startServer({ authTimeoutMs: 150 });
    const raw = await RawPeer.connect(s.port);
    await raw.next('hello');
    const t0 = Date.now();
    await until(() => raw.closed, 2000);
    assert.ok(Date.now() - t0 < 1000);
    assert.equal(s.server.stats.authFailures, 1);
  });

  it('refuses a dead address with PEER_LOST', async () => {
    const srv = net.createServer();
    srv.listen(0, '127.0.0.1');
    await once(srv, 'listening');
    const port = (srv.address() as net.AddressInfo).port;
    await new Promise((r) => srv.close(r));
    const p = startPool();
    await rejectsKv(p.pool.get('127.0.0.1', port), 'PEER_LOST', /ECONNREFUSED/);
  });
});

describe('channel: bad frames', () => {
  it('an oversized frame closes that connection with a logged reason; the server keeps serving', async () => {
    const s = await startServer();
    const { raw } = await RawPeer.authed(s.port);
    await until(() => s.server.connections().length === 1);
    const h = Buffer.alloc(5);
    h.writeUInt32BE(0x7fffffff, 0);
    h[4] = 1;
    raw.send(h);
    await until(() => raw.closed);
    await until(() => s.lost.length === 1);
    assert.match(s.lost[0].reason, /bad frame: control frame of \d+ bytes exceeds cap/);
    assert.equal(s.server.stats.badFrames, 1);
    assert.equal(s.server.stats.peersLost, 1);
    assert.ok(s.log.has(/exceeds cap/));

    const p = startPool();
    const conn = await p.pool.get('127.0.0.1', s.port);
    conn.sendControl({ type: 'kv_ack', room: '9', epoch: p.epoch });
    await until(() => s.got.length === 1);
  });

  it('malformed JSON, unknown types and handshake replays after auth close the connection', async () => {
    const s = await startServer();
    const cases: [Buffer, RegExp][] = [
      [Buffer.concat([Buffer.from([0, 0, 0, 4, 1]), Buffer.from('{x}')]), /not valid JSON/],
      [Buffer.concat([Buffer.from([0, 0, 0, 17, 1]), Buffer.from('{"type":"nope"}X')]), /not valid JSON|unknown control message type/],
      [Buffer.concat([Buffer.from([0, 0, 0, 16, 1]), Buffer.from('{"type":"nope"}')]), /unknown control message type .*nope/],
      [Buffer.from([0, 0, 0, 2, 9, 0]), /unknown frame type 9/],
      [encodeControl({ type: 'hello', nonce: newNonce(), epoch: newEpoch(), role: 'prefill', settings: PAIR }), /handshake message 'hello' after authentication/],
    ];
    for (const [bytes, re] of cases) {
      const { raw } = await RawPeer.authed(s.port);
      raw.send(bytes);
      await until(() => raw.closed, 3000, `close for ${re}`);
      await until(() => s.log.has(re), 1000, `log ${re}`);
    }
    assert.equal(s.server.stats.badFrames, cases.length);
    assert.equal(s.lost.length, cases.length);
    const { raw } = await RawPeer.authed(s.port);
    raw.send(encodeControl({ type: 'ping', seq: 7 }));
    const pong = await raw.next('pong');
    assert.deepEqual(pong, { type: 'pong', seq: 7 });
  });

  it('an unexpected chunk frame on prefill closes the connection', async () => {
    const s = await startServer();
    const { raw } = await RawPeer.authed(s.port);
    raw.send(encodeChunk('5', 0, Buffer.from('data')));
    await until(() => raw.closed);
    assert.ok(s.log.has(/unexpected chunk frame/));
  });
});

describe('channel: epochs', () => {
  it('stale-epoch messages are refused and counted, both ways', async () => {
    const s = await startServer();
    const p = startPool();
    let sc: PeerConn | undefined;
    s.server.onConnect = (c) => (sc = c);
    const conn = await p.pool.get('127.0.0.1', s.port);
    const stale = newEpoch();
    conn.sendControl({ type: 'register', room: '1', rid: 'r', epoch: stale });
    conn.sendControl({ type: 'kv_ack', room: '1', epoch: stale });
    conn.sendControl({ type: 'fail', room: '1', code: 'request_aborted', detail: 'x', epoch: stale });
    conn.sendControl({ type: 'register', room: '2', rid: 'r', epoch: p.epoch });
    await until(() => s.got.length === 1);
    assert.equal((s.got[0].msg as { room: string }).room, '2');
    assert.equal(s.server.stats.staleEpoch, 3);
    assert.ok(s.log.has(/stale epoch/));
    assert.ok(conn.alive, 'a stale message does not close the connection');

    await until(() => sc !== undefined);
    sc!.sendControl({ type: 'fail', room: '2', code: 'request_aborted', detail: 'old', epoch: stale });
    sc!.sendControl({ type: 'fail', room: '2', code: 'request_aborted', detail: 'new', epoch: s.epoch });
    await until(() => p.got.length === 1);
    assert.equal((p.got[0].msg as { detail: string }).detail, 'new');
    assert.equal(p.pool.stats.staleEpoch, 1);
  });
});

describe('channel: chunks', () => {
  it('a 16 MiB blob arrives intact, in order, with bounded queueing', async () => {
    const s = await startServer({ sendWindowBytes: 2 * 1024 * 1024 });
    const blob = randomBytes(16 * 1024 * 1024);
    const recv = Buffer.alloc(blob.length);
    let received = 0;
    let lastEnd = 0;
    let inOrder = true;
    const p = startPool();
    p.pool.onChunk = (_c, room, offset, data) => {
      assert.equal(room, '77');
      if (offset !== lastEnd) inOrder = false;
      lastEnd = offset + data.length;
      data.copy(recv, offset);
      received += data.length;
    };
    let sc: PeerConn | undefined;
    s.server.onConnect = (c) => (sc = c);
    await p.pool.get('127.0.0.1', s.port);
    await until(() => sc !== undefined);
    let progress = 0;
    let maxQueued = 0;
    // bytes handed to the socket so far: flushed to the kernel, plus queued in user space
    const watch = turnWatch(() => progress + sc!.queuedBytes);
    const t0 = performance.now();
    await sc!.sendChunks('77', blob, {
      chunkBytes: 256 * 1024,
      onProgress: (n) => {
        progress += n;
        maxQueued = Math.max(maxQueued, sc!.queuedBytes);
      },
    });
    const ms = performance.now() - t0;
    const { turns, maxStep } = watch.stop();
    await until(() => received === blob.length);
    assert.ok(inOrder);
    assert.equal(progress, blob.length);
    assert.equal(createHash('sha256').update(recv).digest('hex'), createHash('sha256').update(blob).digest('hex'));
    assert.ok(maxQueued <= 2 * 1024 * 1024 + 256 * 1024 + 64, `queued ${maxQueued}`);
    // The send yields: at most one window goes to the socket per loop turn (two when the send's
    // own turn and this watch's fall on either side of one poll), so 16 MiB takes several turns;
    // a send that wrote the blob in one go would show one step of 16 MiB and no turns.
    const window = 2 * 1024 * 1024 + 256 * 1024 + 64;
    assert.ok(maxStep <= 2 * window, `${maxStep} bytes handed to the socket in one loop turn`);
    assert.ok(turns >= 4, `${turns} loop turns during the send`);
    console.log(`# 16 MiB in ${ms.toFixed(0)} ms (${(blob.length / 1e6 / (ms / 1000)).toFixed(0)} MB/s), max queued ${maxQueued}, ${turns} loop turns, max ${maxStep} bytes per turn`);
  });

  /**
   * The rooms of `before` start on one connection to a decode pool that reads slowly (it spins
   * 0.2 ms in every read's chunk callback, and reads nothing until room 99 starts), so our queue
   * stays at the window; room 99 (`after`) starts while it is full. The order on the wire is then decided by which room gets the space
   * each flush frees, not by timing. Returns each room's first and last byte as positions in the
   * stream of chunk bytes received.
   */
  async function sharedConnection(window: number, before: Record<string, Sized>, after: Sized) {
    const s = await startServer({ heartbeatMs: 10_000, sendWindowBytes: window });
    let sc: PeerConn | undefined;
    s.server.onConnect = (c) => (sc = c);
    const p = startPool({ heartbeatMs: 10_000 });
    const at: Record<string, { first: number; last: number }> = {};
    let total = 0;
    p.pool.onChunk = (_c, room, _offset, data) => {
      at[room] ??= { first: total, last: 0 };
      total += data.length;
      at[room].last = total;
      for (const end = performance.now() + 0.2; performance.now() < end; );
    };
    const pc = await p.pool.get('127.0.0.1', s.port);
    await until(() => sc !== undefined);
    // The pool reads nothing until room 99 is queued, so the window is full when it starts on
    // any machine (a reader keeping up on an idle one, or a loaded one, left it short at times).
    pc.pauseReads();
    const sends = Object.entries(before).map(([room, x]) => sc!.sendFrom(room, x.source));
    await until(() => sc!.queuedBytes >= window, 10_000, 'the send window full');
    sends.push(sc!.sendFrom('99', after.source));
    pc.resumeReads();
    const expected = Object.values(before).reduce((n, x) => n + x.bytes, after.bytes);
    await Promise.all(sends);
    await until(() => total === expected, 10_000, 'every byte received');
    return at;
  }
  type Sized = { bytes: number; source: ChunkSource };
  const MiB = 1024 * 1024;
  /**
   * The shape of sendStateFile's source: the envelope head (`head` bytes, its own buffer), the
   * payload through one 1 MiB buffer in four 256 KiB slots (null while all are in flight), then
   * the 4-byte CRC trailer (its own buffer). `bytes` counts all three. `free` holds the slots not
   * in flight (a slot given back twice shows twice).
   */
  function slotted(payload: number, head = 0, trailer = 0): Sized & { free: number[] } {
    const buf = Buffer.alloc(MiB, 3);
    const piece = MiB / 4;
    const free = [3, 2, 1, 0];
    let pos = 0;
    let headSent = head === 0;
    let trailerSent = trailer === 0;
    return {
      bytes: head + payload + trailer,
      free,
      source: {
        next: () => {
          if (!headSent) {
            headSent = true;
            return Buffer.alloc(head, 1);
          }
          if (pos >= payload) {
            if (trailerSent) return undefined;
            trailerSent = true;
            return Buffer.alloc(trailer, 2);
          }
          const slot = free.pop();
          if (slot === undefined) return null;
          const n = Math.min(piece, payload - pos);
          pos += n;
          return buf.subarray(slot * piece, slot * piece + n);
        },
        flushed: (p) => {
          if (p.buffer === buf.buffer) free.push((p.byteOffset - buf.byteOffset) / piece);
        },
      },
    };
  }
  /** A whole blob in 256 KiB pieces, never waiting for a flush (sendChunks). */
  function blob(bytes: number): Sized {
    const buf = Buffer.alloc(bytes, 4);
    let pos = 0;
    return { bytes, source: { next: () => (pos >= bytes ? undefined : buf.subarray(pos, (pos = Math.min(bytes, pos + MiB / 4)))) } };
  }

  it('rooms on one connection take turns: a 1 MiB state started behind twelve 8 MiB ones (the file sender\'s shape) goes out within one turn of theirs', async () => {
    const before: Record<string, ReturnType<typeof slotted>> = {};
    for (let r = 1; r <= 12; r++) before[String(r)] = slotted(8 * MiB, 500, 4);
    // §1's "1 MiB" state: 1 050 089 envelope bytes = head + 4 whole pieces + a 1 769-byte fifth + trailer
    const small = slotted(1_050_089 - 316 - 4, 316, 4);
    const at = await sharedConnection(4 * MiB, before, small);
    for (const x of [...Object.values(before), small] as ReturnType<typeof slotted>[]) assert.deepEqual([...x.free].sort(), [0, 1, 2, 3], 'every slot back once');
    const firstBigEnd = Math.min(...Object.keys(before).map((r) => at[r].last));
    const fmt = (n: number) => (n / MiB).toFixed(2);
    const others = at['99'].last - at['99'].first - small.bytes;
    const where = `room 99 at ${fmt(at['99'].first)}..${fmt(at['99'].last)} MiB (${fmt(others)} MiB of others between), the first 8 MiB room ended at ${fmt(firstBigEnd)} of ${fmt(Object.values(before).reduce((n, x) => n + x.bytes, small.bytes))} MiB`;
    // Before the rotation its pieces went out one per drain, between the others' refills; with a
    // rotation that took the turn from a room that ran dry (all four slots in flight), its fifth
    // piece and trailer waited for a whole rotation: 12 rooms × 1 MiB between its first and last
    // byte. Now it is served first once a slot is back, so what is between is what the others had
    // queued when its first piece left our queue — the send window plus what the kernel's socket
    // buffers held (≈ 6 MiB on loopback here), whatever the number of rooms.
    assert.ok(others < 10 * MiB, `a whole rotation of other rooms' bytes between room 99's first and last byte: ${where}`);
    assert.ok(at['99'].last < firstBigEnd, where);
    console.log(`# ${where}`);
  });

  it('rooms on one connection take turns: a 1 MiB room started behind a 32 MiB blob ends first, its bytes in one turn', async () => {
    // (review F2: before the per-turn yield, room 99 waited for all of room 1.)
    const at = await sharedConnection(4 * MiB, { '1': blob(32 * MiB) }, blob(MiB));
    const where = `room 99 at ${at['99'].first / MiB}..${at['99'].last / MiB} MiB, room 1 ended at ${at['1'].last / MiB} of 33 MiB`;
    assert.ok(at['99'].last < at['1'].last, where);
    assert.ok(at['99'].last - at['99'].first - MiB <= SEND_QUANTUM_BYTES, `more than one turn of room 1 between room 99's first and last byte: ${where}`);
    console.log(`# ${where}`);
  });

  it('rooms on one connection take turns: one aborted mid-send gives every slot back once and the others go on', async () => {
    const s = await startServer({ heartbeatMs: 10_000, sendWindowBytes: 1 * MiB });
    let sc: PeerConn | undefined;
    s.server.onConnect = (c) => (sc = c);
    const p = startPool({ heartbeatMs: 10_000 });
    const got: Record<string, number> = {};
    p.pool.onChunk = (_c, room, _offset, data) => {
      got[room] = (got[room] ?? 0) + data.length;
      for (const end = performance.now() + 0.2; performance.now() < end; );
    };
    await p.pool.get('127.0.0.1', s.port);
    await until(() => sc !== undefined);
    const rooms = ['1', '2', '3'].map(() => slotted(16 * MiB));
    const ac = new AbortController();
    let progress2 = 0;
    const sends = rooms.map((x, i) =>
      sc!.sendFrom(String(i + 1), x.source, {
        signal: i === 1 ? ac.signal : undefined,
        onProgress: i === 1 ? (n) => void ((progress2 += n) >= 2 * MiB && ac.abort(new Error('client gone'))) : undefined,
      }),
    );
    await rejectsKv(sends[1], 'ABORTED', /client gone/);
    await Promise.all([sends[0], sends[2]]);
    await until(() => got['1'] === 16 * MiB && got['3'] === 16 * MiB, 10_000, 'rooms 1 and 3 received');
    assert.ok(got['2'] < 16 * MiB, `room 2 stopped (${got['2']} bytes)`);
    await until(() => rooms[1].free.length === 4, 3000, "room 2's pieces in flight back");
    for (const x of rooms) assert.deepEqual([...x.free].sort(), [0, 1, 2, 3], 'every slot back once');
  });

  it('a peer that does not read: sends stop at the window and time out; abort and close reject', async () => {
    const s = await startServer({ heartbeatMs: 10_000, sendWindowBytes: 1024 * 1024 });
    let sc: PeerConn | undefined;
    s.server.onConnect = (c) => (sc = c);
    const { raw } = await RawPeer.authed(s.port);
    raw.sock.pause();
    await until(() => sc !== undefined);
    const blob = Buffer.alloc(64 * 1024 * 1024, 1);
    const t0 = Date.now();
    const watch = turnWatch();
    await rejectsKv(sc!.sendChunks('1', blob, { stallMs: 300, chunkBytes: 128 * 1024 }), 'TIMEOUT', /stalled: no progress for 300 ms/);
    assert.ok(Date.now() - t0 < 3000);
    // the loop kept turning while the send waited on a full window (a blocked one gives none)
    const { turns } = watch.stop();
    assert.ok(turns >= 10, `${turns} loop turns while stalled`);
    assert.ok(sc!.queuedBytes <= 1024 * 1024 + 128 * 1024 + 64, `queued ${sc!.queuedBytes}`);

    const ac = new AbortController();
    const p = sc!.sendChunks('2', blob, { signal: ac.signal });
    setTimeout(() => ac.abort(new Error('router abort')), 50);
    await rejectsKv(p, 'ABORTED', /router abort/);
    await rejectsKv(sc!.sendChunks('3', blob, { signal: ac.signal }), 'ABORTED');

    const q = sc!.sendChunks('4', blob, {});
    setTimeout(() => sc!.destroy('test teardown'), 50);
    await rejectsKv(q, 'PEER_LOST', /test teardown/);
    await rejectsKv(sc!.sendChunks('5', blob), 'PEER_LOST');
    assert.equal(sc!.sendControl({ type: 'kv_end', room: '5' }), false);
    assert.equal(s.lost.length, 1);
    assert.equal(s.server.stats.peersLost, 0, 'a local destroy is not a lost peer');
  });

  it('a control flood to a peer that does not read hits the queue cap and drops the connection', async () => {
    const s = await startServer({ heartbeatMs: 10_000, maxQueuedBytes: 256 * 1024 });
    let sc: PeerConn | undefined;
    s.server.onConnect = (c) => (sc = c);
    const { raw } = await RawPeer.authed(s.port);
    raw.sock.pause();
    await until(() => sc !== undefined);
    const reason = 'z'.repeat(4000);
    let sent = 0;
    while (sc!.sendControl({ type: 'fail', room: '1', code: 'request_aborted', detail: reason, epoch: s.epoch })) {
      if (++sent > 100_000) assert.fail('cap never hit');
    }
    await until(() => s.lost.length === 1);
    assert.match(s.lost[0].reason, /send queue over cap/);
    assert.equal(s.server.stats.peersLost, 1);
  });

  it('rejects bad arguments', async () => {
    const s = await startServer();
    let sc: PeerConn | undefined;
    s.server.onConnect = (c) => (sc = c);
    await RawPeer.authed(s.port);
    await until(() => sc !== undefined);
    await rejectsKv(sc!.sendChunks('007', Buffer.alloc(10)), 'BAD_FRAME', /room id/);
    await assert.rejects(sc!.sendChunks('7', Buffer.alloc(10), { chunkBytes: 0 }), RangeError);
    await assert.rejects(sc!.sendChunks('7', Buffer.alloc(10), { chunkBytes: 2 * 1024 * 1024 }), RangeError);
    await sc!.sendChunks('7', Buffer.alloc(0));
    assert.throws(() => sc!.sendControl({ type: 'kv_end', room: 'x' }), KvError);
  });

  it('sendFrom: a piece the frame encoder refuses fails the transfer (BAD_FRAME) and still goes back to the source', async () => {
    const s = await startServer();
    let sc: PeerConn | undefined;
    s.server.onConnect = (c) => (sc = c);
    await RawPeer.authed(s.port);
    await until(() => sc !== undefined);
    for (const bad of [Buffer.alloc(0), Buffer.alloc(MAX_CHUNK_BYTES + 1)]) {
      const good = Buffer.alloc(1024, 7);
      const pieces = [good, bad];
      const back: Buffer[] = [];
      const source = { next: () => pieces.shift() ?? null, flushed: (piece: Buffer) => void back.push(piece) };
      await rejectsKv(sc!.sendFrom('8', source), 'BAD_FRAME');
      assert.ok(back.includes(bad), `the refused ${bad.length}-byte piece was given back before the promise settled`);
      await until(() => back.length === 2, 3000, 'the written piece given back once flushed');
      assert.equal(back.filter((b) => b === good).length, 1);
      assert.equal(back.filter((b) => b === bad).length, 1);
    }
  });
  it('reads yield once READ_TURN_BYTES came in one event-loop turn: the socket pauses until the next turn, nothing is lost, a receiver\'s own pause is kept', async () => {
    const s = await startServer();
    const p = startPool();
    let received = 0;
    let inOrder = true;
    p.pool.onChunk = (_c, room, offset, data) => {
      if (room !== '5' || offset !== received) inOrder = false;
      received += data.length;
    };
    const conn = await p.pool.get('127.0.0.1', s.port);
    const sock = (conn as unknown as { socket: net.Socket }).socket;
    // the bytes of several socket reads arriving in one turn, as libuv delivers them (up to 32 reads a poll event)
    const piece = 256 * 1024;
    const frames = (from: number, n: number) => Array.from({ length: n }, (_, i) => Buffer.concat(encodeChunk('5', from + i * piece, Buffer.alloc(piece, i))));
    const turn = Math.ceil(READ_TURN_BYTES / piece) + 2;
    for (const f of frames(0, turn)) conn.received(f);
    assert.equal(received, turn * piece, 'every byte read in the turn is delivered, none held back');
    assert.ok(sock.isPaused(), `the socket stops reading after ${READ_TURN_BYTES} bytes in one turn`);
    await new Promise((r) => setImmediate(r));
    assert.ok(!sock.isPaused(), 'and reads again in the next turn');
    // below the budget in a turn: no pause
    conn.received(frames(turn * piece, 1)[0]!);
    assert.ok(!sock.isPaused(), 'one read is within the budget');
    await new Promise((r) => setImmediate(r));
    // the receiver's own pause (its I/O slots busy) outlives the turn's end
    conn.pauseReads();
    for (const f of frames((turn + 1) * piece, turn)) conn.received(f);
    await new Promise((r) => setImmediate(r));
    assert.ok(sock.isPaused(), 'the receiver\'s pause is still in force after the turn');
    conn.resumeReads();
    assert.ok(!sock.isPaused(), 'resumed once the receiver resumes');
    assert.ok(inOrder);
    assert.equal(received, (2 * turn + 1) * piece);
    // and the socket itself reads on: a blob from the peer arrives whole
    let other = 0;
    p.pool.onChunk = (_c, room, _offset, data) => void (room === '6' && (other += data.length));
    const sc = s.server.connections()[0]!;
    await sc.sendChunks('6', Buffer.alloc(4 * READ_TURN_BYTES, 1), { chunkBytes: piece });
    await until(() => other === 4 * READ_TURN_BYTES, 3000, 'the peer\'s blob');
  });
});

describe('channel: liveness and reconnection', () => {
  it('heartbeats keep an idle connection alive', async () => {
    const s = await startServer({ heartbeatMs: 100 });
    const p = startPool({ heartbeatMs: 100 });
    const conn = await p.pool.get('127.0.0.1', s.port);
    await new Promise((r) => setTimeout(r, 700));
    assert.ok(conn.alive);
    assert.equal(p.lost.length + s.lost.length, 0);
    assert.ok(conn.rttMs !== undefined && conn.rttMs < 1000);
    assert.ok(s.server.stats.framesIn >= 6, 'pings arrived');
  });

  it('a prefill restarted on the same port is reachable again on the next get', async () => {
    const s1 = await startServer();
    const p = startPool();
    const c1 = await p.pool.get('127.0.0.1', s1.port);
    assert.equal(c1.peerEpoch, s1.epoch);
    await s1.server.close();
    await until(() => p.lost.length === 1);
    assert.equal(p.lost[0].conn, c1);
    assert.ok(!c1.alive);
    assert.equal(c1.sendControl({ type: 'kv_end', room: '1' }), false);
    await rejectsKv(p.pool.get('127.0.0.1', s1.port), 'PEER_LOST', /ECONNREFUSED/);

    const s2 = await startServer({ port: s1.port });
    const c2 = await p.pool.get('127.0.0.1', s1.port);
    assert.notEqual(c2, c1);
    assert.equal(c2.peerEpoch, s2.epoch);
    assert.ok(c2.sendControl({ type: 'register', room: '3', rid: 'r', epoch: p.epoch }));
    await until(() => s2.got.length === 1);
    assert.equal(p.pool.stats.peersLost, 1);
  });

  it('a SIGSTOPped prefill is declared lost within 2 heartbeat intervals; our loop stays responsive', async () => {
    const HB = 200;
    const epoch = newEpoch();
    const { child, first } = await spawnChild(['server', SECRET, epoch, String(HB)]);
    const p = startPool({ heartbeatMs: HB });
    const conn = await p.pool.get('127.0.0.1', first.port as number);
    assert.equal(conn.peerEpoch, epoch);
    await new Promise((r) => setTimeout(r, 3 * HB)); // heartbeats flowing
    assert.ok(conn.alive);
    const watch = turnWatch();
    child.kill('SIGSTOP');
    const t0 = Date.now();
    // Keep writing to the frozen peer meanwhile: must not block or buffer without bound.
    const spam = setInterval(() => conn.sendControl({ type: 'register', room: '1', rid: 'r', epoch: p.epoch }), 5);
    await until(() => p.lost.length === 1, 5 * HB, 'peer lost');
    const dt = Date.now() - t0;
    clearInterval(spam);
    const { turns } = watch.stop();
    child.kill('SIGCONT');
    assert.match(p.lost[0].reason, /peer silent for \d+ ms/);
    assert.ok(dt <= 2.5 * HB, `lost after ${dt} ms (heartbeat ${HB})`);
    assert.ok(dt >= HB / 2, `lost too early: ${dt} ms`);
    // Writing to the frozen peer never holds the loop: it kept turning until the loss (counted
    // in turns, not milliseconds, so a loaded machine cannot fail it; a blocked loop gives none).
    assert.ok(turns >= 10, `${turns} loop turns while the peer was frozen`);
    assert.equal(p.pool.stats.peersLost, 1);
    // The same prefill, thawed, is usable again on the next get.
    const again = await p.pool.get('127.0.0.1', first.port as number);
    assert.ok(again.alive && again !== conn);
    console.log(`# frozen prefill lost after ${dt} ms (heartbeat ${HB} ms), ${turns} loop turns`);
  });

  it('a SIGSTOPped decode receiving a large blob: transfer rejects, peer lost in time, loop responsive', async () => {
    const HB = 200;
    const blob = Buffer.alloc(64 * 1024 * 1024, 3); // before connecting: allocating blocks our loop
    const s = await startServer({ heartbeatMs: HB });
    let sc: PeerConn | undefined;
    s.server.onConnect = (c) => (sc = c);
    const { child } = await spawnChild(['pool', String(s.port), SECRET, newEpoch(), String(HB)]);
    await until(() => sc !== undefined, 5000);
    let progress = 0;
    let t0 = 0;
    const watch = turnWatch(() => progress + sc!.queuedBytes);
    const sending = sc!.sendChunks('11', blob, {
      stallMs: 60_000,
      onProgress: (n) => {
        progress += n;
        if (!t0 && progress >= 8 * 1024 * 1024) {
          child.kill('SIGSTOP');
          t0 = Date.now();
        }
      },
    });
    const err = await rejectsKv(sending, 'PEER_LOST', /peer silent/);
    const dt = Date.now() - t0;
    const { turns, maxStep } = watch.stop();
    child.kill('SIGCONT');
    assert.ok(t0 > 0 && progress < blob.length, `progress ${progress}`);
    assert.ok(dt <= 2.5 * HB, `lost after ${dt} ms: ${err.message}`);
    // The send yields while it sends: at most one window per loop turn (two when its turn and
    // this watch's fall on either side of one poll), and the loop kept turning (in turns, not
    // milliseconds, so a loaded machine cannot fail it; a send holding the loop gives none).
    const window = 4 * 1024 * 1024 + MAX_CHUNK_BYTES + 64;
    assert.ok(maxStep <= 2 * window, `${maxStep} bytes handed to the socket in one loop turn`);
    assert.ok(turns >= 10, `${turns} loop turns during the send`);
    assert.equal(s.lost.length, 1);
    assert.equal(s.server.stats.peersLost, 1);
    console.log(`# frozen decode lost after ${dt} ms (heartbeat ${HB} ms), ${(progress / 1048576).toFixed(1)} MiB flushed, ${turns} loop turns, max ${maxStep} bytes per turn`);
  });
});

describe('channel: close', () => {
  it('close() is idempotent, drains, fires onPeerLost once, and refuses later gets', async () => {
    const s = await startServer();
    const p = startPool();
    const conn = await p.pool.get('127.0.0.1', s.port);
    await until(() => s.server.connections().length === 1);
    conn.sendControl({ type: 'kv_ack', room: '1', epoch: p.epoch });
    await Promise.all([p.pool.close(), p.pool.close()]);
    await until(() => s.got.length === 1, 1000, 'message sent before close delivered');
    assert.equal(p.lost.length, 1);
    assert.match(p.lost[0].reason, /pool closing/);
    assert.equal(p.pool.stats.peersLost, 0);
    await rejectsKv(p.pool.get('127.0.0.1', s.port), 'PEER_LOST', /closed/);
    await until(() => s.lost.length === 1);
    await Promise.all([s.server.close(), s.server.close()]);
    s.server.destroy();
  });

  it('closing the pool aborts a pending connect', async () => {
    const srv = net.createServer((sock) => sock.on('error', () => {}));
    srv.listen(0, '127.0.0.1');
    await once(srv, 'listening');
    cleanups.push(() => srv.close());
    const p = startPool();
    const g = p.pool.get('127.0.0.1', (srv.address() as net.AddressInfo).port);
    setTimeout(() => p.pool.destroy(), 30);
    await rejectsKv(g, 'PEER_LOST');
  });
});

describe('channel: TLS (transport.ts)', () => {
  const pki = makeTestPki();
  const serverTls = tlsTransport({ cert: pki.pem.cert, key: pki.pem.key, ca: pki.pem.ca });

  it('mutual TLS: a pool with a certificate the CA signed authenticates and moves a 4 MiB blob intact', async () => {
    const s = await startServer({ transport: serverTls });
    let sc: PeerConn | undefined;
    s.server.onConnect = (c) => (sc = c);
    const p = startPool({ transport: tlsTransport({ cert: pki.pem.cert, key: pki.pem.key, ca: pki.pem.ca }) });
    const blob = randomBytes(4 * 1024 * 1024);
    const recv = Buffer.alloc(blob.length);
    let received = 0;
    p.pool.onChunk = (_c, _room, offset, data) => {
      data.copy(recv, offset);
      received += data.length;
    };
    await p.pool.get('127.0.0.1', s.port);
    await until(() => sc !== undefined);
    await sc!.sendChunks('5', blob, { chunkBytes: 256 * 1024 });
    await until(() => received === blob.length);
    assert.ok(recv.equals(blob));
    assert.equal(s.server.stats.authFailures + p.pool.stats.authFailures, 0);
  });

  it('a pool without a client certificate, or with one another CA signed, is refused in the TLS handshake and counted', async () => {
    const s = await startServer({ transport: serverTls });
    for (const t of [tlsTransport({ ca: pki.pem.ca }), tlsTransport({ ca: pki.pem.ca, cert: pki.pem.strangerCert, key: pki.pem.strangerKey })]) {
      const p = startPool({ transport: t });
      await assert.rejects(p.pool.get('127.0.0.1', s.port), (e: unknown) => e instanceof KvError && (e.code === 'PEER_LOST' || e.code === 'AUTH_FAILED'));
    }
    await until(() => s.server.stats.authFailures === 2, 3000, 'two TLS refusals counted');
    assert.ok(s.log.has(/refused in the TLS handshake/));
    assert.equal(s.server.connections().length, 0);
  });

  it('a pool that does not trust the server certificate refuses it; a plain TCP pool gets nowhere', async () => {
    const s = await startServer({ transport: serverTls });
    const untrusting = startPool({ transport: tlsTransport({ cert: pki.pem.cert, key: pki.pem.key, ca: pki.pem.strangerCert }) });
    await rejectsKv(untrusting.pool.get('127.0.0.1', s.port), 'PEER_LOST', /CERT|certificate/);
    const plain = startPool({ authTimeoutMs: 500 });
    await assert.rejects(plain.pool.get('127.0.0.1', s.port), (e: unknown) => e instanceof KvError);
    assert.equal(s.server.connections().length, 0);
  });
});
