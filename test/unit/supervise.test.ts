/** `pdserve up`'s supervisor decision (up/supervise.ts): restart crashes, not requested drains. */
import assert from 'node:assert/strict';
import { test } from 'node:test';
import type { ChildProcess } from 'node:child_process';
import { superviseAction, unexpectedExitLine } from '../../src/up/supervise.js';

test('a crash is restarted; an exit 0 after a drain it was asked for stays stopped; live, expected-down or draining-up processes are left alone', () => {
  const at = 1;
  assert.equal(superviseAction({ expectedDown: false, lastExit: { code: 0, signal: null, at } }, false), 'stopped');
  assert.equal(superviseAction({ expectedDown: false, lastExit: { code: 1, signal: null, at } }, false), 'restart');
  assert.equal(superviseAction({ expectedDown: false, lastExit: { code: null, signal: 'SIGKILL', at } }, false), 'restart');
  assert.equal(superviseAction({ expectedDown: false }, false), 'restart', 'gone without a recorded exit');
  assert.equal(superviseAction({ expectedDown: true, lastExit: { code: 1, signal: null, at } }, false), 'none');
  assert.equal(superviseAction({ expectedDown: false, lastExit: { code: 1, signal: null, at } }, true), 'none', 'up is draining');
  assert.equal(superviseAction({ child: {} as ChildProcess, expectedDown: false, lastExit: { code: 0, signal: null, at } }, false), 'none', 'running again');
});

test("up's line for a worker that died names the signal that killed it (or its exit code) and its log", () => {
  const at = 1;
  assert.equal(unexpectedExitLine({ name: 'decode-1', lastExit: { code: null, signal: 'SIGKILL', at }, logFile: '/tmp/l/decode-1.log' }), 'pdserve: decode-1 exited unexpectedly (SIGKILL; log: /tmp/l/decode-1.log); restarting it');
  assert.equal(unexpectedExitLine({ name: 'prefill-0', lastExit: { code: 3, signal: null, at } }), 'pdserve: prefill-0 exited unexpectedly (exit code 3); restarting it');
  assert.equal(unexpectedExitLine({ name: 'decode-0' }), 'pdserve: decode-0 exited unexpectedly (no exit status seen); restarting it');
});
