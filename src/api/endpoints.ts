/**
 * The OpenAI-compatible endpoints around generation, shared by the router, the colocated server
 * and the workers:
 *
 *   GET  /v1/models/{id}  OpenAI's retrieve-model object; 404 model_not_found for another id.
 *   POST /tokenize        vLLM's shape: {prompt, add_special_tokens=true, return_token_strs=false}
 *                         or {messages, add_generation_prompt=true, return_token_strs=false}
 *                         → {count, max_model_len, tokens, token_strs}.
 *   POST /detokenize      vLLM's shape: {tokens} → {prompt}.
 *   CORS                  `@fastify/cors` for the configured origins (preflight included); none
 *                         configured = no CORS headers (browsers refuse cross-origin calls).
 * Wrong methods on a known path get 405 with an `Allow` header (see ./errors.ts).
 */
import { redactAddresses } from '../base/redact.js';
import cors from '@fastify/cors';
import type { FastifyInstance, FastifyReply, FastifyRequest } from 'fastify';
import { request, type Dispatcher } from 'undici';
import { z, ZodError } from 'zod';
import type { Engine } from '../engine/types.js';
import { ApiError, checkModelName, zodToApiError } from './errors.js';
import { parseMessages } from './parse.js';
import { parseTools } from './tool-calls.js';
import { TOOLS_REFUSAL } from './fields.js';

/** The OpenAI model object. */
export interface ModelObject {
  id: string;
  object: 'model';
  owned_by: 'pdserve';
  created: number;
}

/**
 * GET /v1/models/{id}: the model object when `models()` lists the id, else 404 model_not_found
 * (OpenAI's error). `created` is unix seconds.
 */
export function registerModelRoute(app: FastifyInstance, models: () => string[], created: number): void {
  app.get<{ Params: { id: string } }>('/v1/models/:id', async (req) => {
    const id = req.params.id;
    checkModelName(id, models());
    if (models().length === 0) throw ApiError.of('model_not_found', `The model '${id}' does not exist`, 'model');
    const m: ModelObject = { id, object: 'model', owned_by: 'pdserve', created };
    return m;
  });
}

/**
 * CORS for `origins` ('*' = any origin), through @fastify/cors: preflight (OPTIONS) answered
 * with the allowed methods and the requested headers, `x-request-id` exposed. No origins = no
 * CORS. Call before the app is ready.
 */
export function registerCors(app: FastifyInstance, origins: readonly string[]): void {
  if (origins.length === 0) return;
  // Loaded by fastify before the app is ready; its hooks apply to routes declared before it too.
  void app.register(cors, {
    origin: origins.includes('*') ? '*' : [...origins],
    methods: ['GET', 'POST', 'OPTIONS'],
    exposedHeaders: ['x-request-id'],
    maxAge: 600,
  });
}

const MAX_TOKENS_LIST = 1 << 20;

const TokenizeCompletionSchema = z
  .object({
    model: z.string().max(512).nullish(),
    prompt: z.string(),
    add_special_tokens: z.boolean().nullish(),
    return_token_strs: z.boolean().nullish(),
  })
  .strict();

const TokenizeChatSchema = z
  .object({
    model: z.string().max(512).nullish(),
    messages: z.unknown(),
    /** vLLM: the tools the chat template documents (counted as the generation request would). */
    tools: z.array(z.unknown()).nullish(),
    add_generation_prompt: z.literal(true, { errorMap: () => ({ message: 'only true is supported' }) }).nullish(),
    add_special_tokens: z.literal(false, { errorMap: () => ({ message: "only false is supported (BOS comes from the model's chat template)" }) }).nullish(),
    return_token_strs: z.boolean().nullish(),
  })
  .strict();

const DetokenizeSchema = z.object({ model: z.string().max(512).nullish(), tokens: z.array(z.number().int().min(0)).max(MAX_TOKENS_LIST) }).strict();

/** zod error → 400 naming the field; unknown keys → 400 'Unrecognized request argument supplied'. */
function toBadRequest(err: ZodError): ApiError {
  const i = err.issues[0];
  if (i?.code === 'unrecognized_keys') {
    const k = i.keys[0] ?? '';
    return ApiError.of('unrecognized_argument', `Unrecognized request argument supplied: ${k}`, k);
  }
  return zodToApiError(err);
}

/** vLLM's /tokenize response. */
export interface TokenizeResponse {
  count: number;
  max_model_len: number;
  tokens: number[];
  token_strs: string[] | null;
}

/**
 * POST /tokenize and POST /detokenize on `engine` (see the file comment for the shapes).
 * @throws (as HTTP 400) for bad bodies, token ids outside the vocabulary, refused message fields.
 */
export function registerTokenizeRoutes(app: FastifyInstance, engine: Engine, models: readonly string[] = []): void {
  app.post('/tokenize', async (req) => {
    const body = req.body as Record<string, unknown> | null;
    const isChat = body !== null && typeof body === 'object' && 'messages' in body;
    let tokens: number[];
    let strs = false;
    if (isChat) {
      const r = TokenizeChatSchema.safeParse(body);
      if (!r.success) throw toBadRequest(r.error);
      checkModelName(r.data.model ?? undefined, models);
      const tools = parseTools({ tools: r.data.tools ?? undefined });
      if (tools && !engine.toolSyntax) throw ApiError.of('unsupported_value', `Unsupported value for 'tools': ${TOOLS_REFUSAL}`, 'tools');
      tokens = engine.renderChat(parseMessages(r.data.messages), tools?.functions);
      strs = r.data.return_token_strs === true;
    } else {
      const r = TokenizeCompletionSchema.safeParse(body);
      if (!r.success) throw toBadRequest(r.error);
      checkModelName(r.data.model ?? undefined, models);
      const maxBytes = engine.info.compat.contextSize * engine.info.maxTokenBytes * 4;
      if (Buffer.byteLength(r.data.prompt) > maxBytes) throw ApiError.of('invalid_value', `prompt is longer than ${maxBytes} bytes`, 'prompt');
      tokens = engine.tokenize(r.data.prompt, r.data.add_special_tokens !== false);
      strs = r.data.return_token_strs === true;
    }
    const out: TokenizeResponse = { count: tokens.length, max_model_len: engine.info.compat.contextSize, tokens, token_strs: strs ? engine.tokenPieces(tokens) : null };
    return out;
  });
  app.post('/detokenize', async (req) => {
    const r = DetokenizeSchema.safeParse(req.body);
    if (!r.success) throw toBadRequest(r.error);
    checkModelName(r.data.model ?? undefined, models);
    const bad = r.data.tokens.find((t) => t >= engine.info.nVocab);
    if (bad !== undefined) throw ApiError.of('invalid_value', `token id ${bad} is outside the vocabulary (size ${engine.info.nVocab})`, 'tokens');
    return { prompt: engine.detokenize(r.data.tokens) };
  });
}

/** Largest answer read from a worker's /tokenize, bytes. */
const MAX_PROXY_BODY = 16 * 1024 * 1024;

/**
 * Router side: POST /tokenize and /detokenize are forwarded to a healthy prefill worker
 * (`pickUrl`), status and body passed through; 503 when there is none, 502 when it fails.
 */
export function registerTokenizeProxy(app: FastifyInstance, pickUrl: () => string | null, dispatcher: Dispatcher, timeoutMs: number): void {
  const forward = (path: string) => async (req: FastifyRequest, reply: FastifyReply) => {
    const url = pickUrl();
    if (!url) throw ApiError.of('no_healthy_prefill', 'no healthy prefill worker to tokenize with');
    let res: Dispatcher.ResponseData;
    try {
      res = await request(`${url}${path}`, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify(req.body ?? null), dispatcher, signal: AbortSignal.timeout(timeoutMs) });
    } catch (err) {
      req.log.warn({ worker: url, err: (err as Error).message }, 'tokenize proxy: prefill unreachable');
      throw ApiError.of('prefill_unreachable', `prefill worker: ${redactAddresses((err as Error).message)}`);
    }
    const chunks: Buffer[] = [];
    let n = 0;
    for await (const c of res.body) {
      n += (c as Buffer).length;
      if (n > MAX_PROXY_BODY) {
        res.body.destroy();
        throw ApiError.of('bad_worker_answer', `prefill worker's ${path} answer exceeds ${MAX_PROXY_BODY} bytes`);
      }
      chunks.push(c as Buffer);
    }
    return reply.code(res.statusCode).type('application/json; charset=utf-8').send(Buffer.concat(chunks));
  };
  app.post('/tokenize', forward('/tokenize'));
  app.post('/detokenize', forward('/detokenize'));
}
