/**
 * The one error model (src/base/errors.ts), the one room-id type (src/base/room-id.ts), and the
 * request bounds checked before per-item work.
 * Source-scanning tests: they fail when a new call site drifts from the single table / rule.
 */
import assert from 'node:assert/strict';
import { readdirSync, readFileSync, statSync } from 'node:fs';
import { join, relative, resolve, dirname } from 'node:path';
import { fileURLToPath } from 'node:url';
import { describe, test } from 'node:test';
import { ApiError, causeOf, ConfigError, ERROR_CODES, errorCodeOf, INTERNAL_TO_API, InternalError, isErrorCode, isInternalCode, PdError, toApiError } from '../../src/base/errors.js';
import { startupProblem } from '../../src/cli/serve.js';
import { isRoomId, newRoomId, parseRoomId } from '../../src/base/room-id.js';
import { abortCauseOf, checkRequestBounds, GenerateRequestSchema, MAX_ABORT_CAUSE_CHARS, MAX_MESSAGES } from '../../src/protocol/worker-protocol.js';
import { parseChatRequest } from '../../src/api/parse.js';

const SRC = resolve(dirname(fileURLToPath(import.meta.url)), '../../src');
function files(dir: string): string[] {
  return readdirSync(dir).flatMap((n) => {
    const p = join(dir, n);
    return statSync(p).isDirectory() ? files(p) : p.endsWith('.ts') ? [p] : [];
  });
}
const SOURCES = files(SRC).map((p) => ({ path: relative(SRC, p), text: readFileSync(p, 'utf8') }));

describe('error model', () => {
  test('every `new ApiError(status, code)` in src agrees with the one code → status table', () => {
    let n = 0;
    for (const f of SOURCES) {
      for (const m of f.text.matchAll(/new ApiError\(\s*(\d{3}),\s*'([a-z_]+)'/g)) {
        n++;
        const [, status, code] = m;
        assert.ok(isErrorCode(code), `${f.path}: code '${code}' is not in ERROR_CODES`);
        assert.equal(ERROR_CODES[code as keyof typeof ERROR_CODES].status, Number(status), `${f.path}: '${code}' answered ${status}, the table says ${ERROR_CODES[code as keyof typeof ERROR_CODES].status}`);
      }
      for (const m of f.text.matchAll(/ApiError\.of\('([a-z_]+)'/g)) {
        n++;
        assert.ok(isErrorCode(m[1]), `${f.path}: ApiError.of('${m[1]}') is not in the table`);
      }
    }
    assert.ok(n > 50, `scanned ${n} call sites`);
  });

  test('one base class: every error class in src derives from PdError (an ApiError carries a table code, typed)', () => {
    const direct = SOURCES.flatMap((f) => [...f.text.matchAll(/class (\w+) extends Error\b/g)].map((m) => `${f.path}: ${m[1]}`));
    assert.deepEqual(direct, ['base/errors.ts: PdError']);
    const e = new ApiError(502, 'decode_failed', 'x');
    assert.ok(e instanceof PdError && e.code === 'decode_failed');
  });

  test('client-caused vs system faults: 4xx/499 are the client\'s, 5xx the system\'s', () => {
    for (const [code, spec] of Object.entries(ERROR_CODES)) {
      assert.equal(spec.cause, spec.status < 500 ? 'client' : 'system', code);
    }
    assert.equal(causeOf('request_aborted'), 'client');
    assert.equal(causeOf('context_length_exceeded'), 'client');
    assert.equal(causeOf('peer_lost'), 'system');
    assert.equal(causeOf('some_unknown_code'), 'system');
  });

  test('errors thrown inside processes map through the table by code, never by message text', () => {
    const cases: [PdError, string, number][] = [
      [new PdError('PROMPT_TOO_LONG', 'x'), 'context_length_exceeded', 400],
      [new PdError('BAD_STATE', 'x'), 'bad_state', 502],
      [new PdError('SETTINGS_MISMATCH', 'x'), 'settings_mismatch', 502],
      [new PdError('ABORTED', 'deadline exceeded'), 'request_aborted', 499],
      [new PdError('SOMETHING_NEW', 'kv_transfer_failed'), 'internal_error', 500],
    ];
    for (const [e, code, status] of cases) {
      const a = toApiError(e);
      assert.equal(a.code, code);
      assert.equal(a.status, status);
    }
    assert.equal(ApiError.fromFailure({ code: 'room_deadline_expired', detail: 'deadline:waiting' }).status, 504);
  });

  test('no untyped errors: no `new Error(` or ad hoc `Object.assign(new Error, {code})` in src (outside bench, storm, sim)', () => {
    // tools and simulations (bench, storm, sim) report to their operator, not to a client or a pdserve log
    const product = SOURCES.filter((f) => !/^(bench|storm|sim)\//.test(f.path));
    assert.ok(product.length > 100, `scanned ${product.length} files`);
    const at = (re: RegExp) => product.flatMap((f) => f.text.split('\n').flatMap((line, i) => (re.test(line) ? [`${f.path}:${i + 1}`] : [])));
    assert.deepEqual(at(/throw new Error\(/), [], 'throw a PdError subclass with a code (InternalError for a broken invariant, ConfigError for a start-up configuration)');
    assert.deepEqual(at(/Object\.assign\(new Error\b/), [], 'an error with a code is a PdError, typed');
    assert.deepEqual(at(/\bnew Error\(/), [], 'no bare Error at all (a stream loop stop sentinel is typed too: router/leg.ts)');
  });

  test("every internal code maps to a table code: the channel's, the engine's and the SSE writer's among them", () => {
    for (const [internal, api] of Object.entries(INTERNAL_TO_API)) {
      assert.ok(isErrorCode(api), `${internal} → ${api} is not a table code`);
      assert.ok(!isErrorCode(internal), `${internal} is both a table and an internal code`);
    }
    const expect: [string, string, number][] = [
      ['BAD_FRAME', 'kv_transfer_failed', 502],
      ['SLOT_RELEASED', 'internal_error', 500],
      ['ENGINE_DISPOSED', 'shutting_down', 503],
      ['BAD_GRAMMAR', 'invalid_value', 400],
      ['KEY_MISMATCH', 'bad_state', 502],
      ['SSE_CLOSED', 'client_closed_request', 499],
      ['INTERNAL', 'internal_error', 500],
    ];
    for (const [internal, code, status] of expect) {
      const a = toApiError(new PdError(internal as keyof typeof INTERNAL_TO_API, 'x'));
      assert.deepEqual([a.code, a.status], [code, status], internal);
    }
    assert.equal(errorCodeOf(new InternalError('a broken invariant')), 'internal_error');
    assert.equal(toApiError(new Error('anything untyped')).status, 500);
    const cfg = new ConfigError('--x: not a number');
    assert.ok(cfg instanceof PdError && cfg.code === 'invalid_config');
    assert.equal(startupProblem(cfg), '--x: not a number', 'a ConfigError is printed as the user\'s problem, without a stack');
  });

  test('every code a PdError is built with in src is a table or an internal code', () => {
    let n = 0;
    for (const f of SOURCES) {
      for (const m of f.text.matchAll(/new (?:PdError|EngineError|KvError|SseError)\(\s*'([A-Za-z_]+)'/g)) {
        n++;
        assert.ok(isErrorCode(m[1]) || isInternalCode(m[1]), `${f.path}: '${m[1]}' is in neither table`);
      }
    }
    assert.ok(n > 50, `scanned ${n} sites`);
  });

  test('status and type come from the code: `ApiError.of`, with `new ApiError(status, …)` only where a status is relayed', () => {
    const literal = SOURCES.filter((f) => /new ApiError\(\s*\d{3},/.test(f.text)).map((f) => f.path).sort();
    // an unknown route's 404 keeps the type not_found_error (the table's not_found is an unknown object id)
    const relays = ['api/errors.ts'];
    // call sites still to convert (their statuses agree with the table: checked above); shrink it, never grow it
    const toConvert = ['router/attempts.ts', 'router/dispatch.ts', 'router/index.ts'];
    assert.deepEqual(literal.filter((p) => !relays.includes(p) && !toConvert.includes(p)), []);
    const a = ApiError.of('rate_limited', 'slow down');
    assert.deepEqual([a.status, a.type], [429, 'rate_limit_error']);
    const moved = a.with({ message: 'm', param: 'p' });
    assert.deepEqual([moved.status, moved.type, moved.code, moved.message, moved.param], [429, 'rate_limit_error', 'rate_limited', 'm', 'p']);
  });

  test("an /abort_request's cause is a room failure only with a table code and a string message (cut to its bound)", () => {
    assert.deepEqual(abortCauseOf({ code: 'prefill_refused', message: 'prefill refused the request: 400 context_length_exceeded: x' }), { code: 'prefill_refused', detail: 'prefill refused the request: 400 context_length_exceeded: x' });
    assert.equal(abortCauseOf({ code: 'prefill_refused', message: 'y'.repeat(10_000) })!.detail.length, MAX_ABORT_CAUSE_CHARS);
    for (const bad of [undefined, null, 'prefill_refused', { code: 'no_such_code', message: 'x' }, { code: 'prefill_refused' }, { code: 'prefill_refused', message: 7 }]) assert.equal(abortCauseOf(bad), undefined, JSON.stringify(bad));
  });
});

describe('room ids', () => {
  test('one canonicaliser: strings, safe integers and bigints in u64 range, canonical form', () => {
    assert.equal(parseRoomId('007'), '7');
    assert.equal(parseRoomId(42), '42');
    assert.equal(parseRoomId(18446744073709551615n), '18446744073709551615');
    for (const bad of ['18446744073709551616', '1e3', '', ' 7', '-1', -1, 1.5, Number.MAX_SAFE_INTEGER + 2, null, undefined, {}]) assert.equal(parseRoomId(bad), undefined, String(bad));
    assert.ok(isRoomId('0') && !isRoomId('00'));
    const g = GenerateRequestSchema.safeParse({ rid: 'r', text: 'x', bootstrap_host: 'h', bootstrap_port: 1, bootstrap_room: '0042' });
    assert.ok(g.success && g.data.bootstrap_room === '42', 'the /generate schema uses the same canonicaliser');
  });

  test('one generator: 63-bit ids, from a seeded source when given one', () => {
    for (let i = 0; i < 100; i++) assert.ok(BigInt(newRoomId()) < 1n << 63n);
    assert.equal(newRoomId(() => (1n << 64n) - 1n), String((1n << 63n) - 1n));
    const generators = SOURCES.filter((f) => /0x7fff_?ffff_?ffff_?ffff|readBigUInt64BE\(0\)\s*&/.test(f.text)).map((f) => f.path);
    assert.deepEqual(generators, ['base/room-id.ts'], 'room ids are drawn in one place');
  });
});

describe('request-controlled counts are bounded before per-item work', () => {
  test('250k empty messages are refused by an O(1) length check (worker and router)', () => {
    const body = { rid: 'r', messages: Array.from({ length: 250_000 }, () => ({ role: 'user', content: '' })), bootstrap_host: 'h', bootstrap_port: 1, bootstrap_room: 1 };
    const e = checkRequestBounds(body, { maxMessages: MAX_MESSAGES, maxPromptTokens: 2048 });
    assert.ok(e instanceof ApiError);
    assert.equal(e.status, 400);
    assert.equal(e.code, 'request_too_large');
    assert.equal(e.param, 'messages');
    assert.throws(() => parseChatRequest({ model: 'm', messages: body.messages }), (err: ApiError) => err.code === 'request_too_large' && err.status === 400);
    assert.equal(checkRequestBounds({ messages: body.messages.slice(0, 10) }, { maxMessages: MAX_MESSAGES, maxPromptTokens: 2048 }), undefined);
    const ids = checkRequestBounds({ input_ids: new Array(5000).fill(1) }, { maxMessages: MAX_MESSAGES, maxPromptTokens: 2048 });
    assert.equal(ids?.code, 'context_length_exceeded');
    assert.equal(ids?.param, 'prompt', 'named as the OpenAI field the router passes it through for');
  });
});
