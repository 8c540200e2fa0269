/**
 * Turning a worker `/generate` body into engine inputs. Shared by prefill, decode and colocated
 * so every role tokenizes and samples identically (PD output must equal colocated output).
 */
import type { GenerateRequest } from './worker-protocol.js';
import type { Engine, SamplingParams } from '../engine/types.js';
import { ApiError } from '../common/errors.js';

/** Worker sampling_params → engine SamplingParams. */
export function samplingFromWire(s: GenerateRequest['sampling_params']): SamplingParams {
  return {
    temperature: s.temperature,
    topP: s.top_p,
    topK: s.top_k,
    seed: s.seed,
    maxTokens: s.max_new_tokens,
    stop: s.stop,
    ignoreEos: s.ignore_eos,
  };
}

/**
 * Prompt tokens of a request: input_ids as given, text tokenized, messages rendered with the
 * model's chat template. @throws ApiError 400 for an empty prompt or out-of-vocabulary ids.
 */
export function tokenizeRequest(engine: Engine, body: Pick<GenerateRequest, 'text' | 'input_ids' | 'messages'>): number[] {
  // A prompt that cannot fit is refused before tokenizing: tokenizing megabytes takes seconds
  // of event loop, long enough for the KV channel's peers to declare this process lost.
  const bytes = body.text !== undefined ? Buffer.byteLength(body.text) : (body.messages ?? []).reduce((n, m) => n + Buffer.byteLength(m.content), 0);
  const atLeast = Math.floor(bytes / engine.info.maxTokenBytes);
  if (atLeast > engine.info.compat.contextSize) {
    throw new ApiError(400, 'context_length_exceeded', `the prompt (${bytes} bytes, at least ${atLeast} tokens) exceeds the context size (${engine.info.compat.contextSize} tokens)`, 'invalid_request_error', body.messages ? 'messages' : 'prompt');
  }
  let tokens: number[];
  if (body.input_ids) {
    const n = engine.info.nVocab;
    const bad = body.input_ids.find((t) => t >= n);
    if (bad !== undefined) throw new ApiError(400, 'invalid_token', `token id ${bad} is outside the vocabulary (size ${n})`, 'invalid_request_error', 'prompt');
    tokens = body.input_ids;
  } else if (body.messages) {
    if (body.messages.length === 0) throw new ApiError(400, 'invalid_request', 'messages must not be empty', 'invalid_request_error', 'messages');
    tokens = engine.renderChat(body.messages);
  } else {
    tokens = engine.tokenize(body.text ?? '');
  }
  if (tokens.length === 0) throw new ApiError(400, 'empty_prompt', 'the prompt is empty (0 tokens)', 'invalid_request_error', 'prompt');
  return tokens;
}
