/**
 * TraceTags: the /debug/rooms row decorations a worker keeps per room — the trace id, and the
 * facts decode notes when it lets a room go (path, kv_path, cached_tokens), so a `recent` row still
 * shows them after the request ended; a live row's own fields win; bounded (oldest forgotten).
 */
import assert from 'node:assert/strict';
import { test } from 'node:test';
import { TraceTags } from '../../src/protocol/trace-tags.js';

test('noted facts appear on recent rows, a row\'s own fields win, the trace survives a note, the oldest room is forgotten', () => {
  const t = new TraceTags(2);
  t.set('r1', 'trace-1');
  t.note('r1', { path: 'decode_local', kv_path: null, cached_tokens: 512 });
  t.note('r2', { path: 'pd', kv_path: 'same_host', cached_tokens: 0 });
  const body = t.tag({ epoch: 1, live: [{ room: 'r2', path: 'live-value' }], recent: [{ room: 'r1', state: 'Success' }, { room: 'r9', state: 'Failed' }] });
  assert.deepEqual(body.recent, [
    { path: 'decode_local', kv_path: null, cached_tokens: 512, room: 'r1', state: 'Success', trace: 'trace-1' },
    { room: 'r9', state: 'Failed', trace: null },
  ]);
  assert.deepEqual(body.live, [{ path: 'live-value', kv_path: 'same_host', cached_tokens: 0, room: 'r2', trace: null }]);
  t.set('r2', 'trace-2'); // keeps r2's facts
  assert.deepEqual(t.tag({ recent: [{ room: 'r2' }] }).recent, [{ path: 'pd', kv_path: 'same_host', cached_tokens: 0, room: 'r2', trace: 'trace-2' }]);
  t.set('r3', 'trace-3'); // max 2: r1 (oldest) is forgotten
  assert.deepEqual(t.tag({ recent: [{ room: 'r1' }] }).recent, [{ room: 'r1', trace: null }]);
});
