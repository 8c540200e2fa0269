/** `pdserve up`'s supervisor decision (up/supervise.ts): restart crashes, not requested drains. */
import assert from 'node:assert/strict';
import { test } from 'node:test';
import type { ChildProcess } from 'node:child_process';
import { superviseAction } from '../../src/up/supervise.js';

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
