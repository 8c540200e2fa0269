/**
 * A request's prompt → tokens, as pure functions of a loaded model (full or vocabulary-only):
 * the chat wrapper a model uses, plain-text tokenization with the model's BOS rule, and chat
 * rendering through the wrapper. One code path for the engine (src/engine/llama.ts, on the
 * event loop) and the tokenizer thread (./tokenizer-worker.ts, off it), so both give the same
 * tokens for the same input.
 */
import { GeneralChatWrapper, resolveChatWrapper, type ChatWrapper, type LlamaModel, type Tokenizer } from 'node-llama-cpp';
import { chatFunctionsOf, chatHistoryOf } from './tools.js';
import type { ChatMessage, ToolFunction } from './types.js';

/**
 * The model's own chat template when the GGUF has one; the generic wrapper otherwise
 * (resolveChatWrapper would guess from the architecture, e.g. Llama-2 [INST] for any llama GGUF).
 */
export function chatWrapperOf(model: LlamaModel): ChatWrapper {
  const tmpl = (model.fileInfo.metadata as unknown as { tokenizer?: { chat_template?: unknown } }).tokenizer?.chat_template;
  return typeof tmpl === 'string' && tmpl.length > 0 ? resolveChatWrapper(model) : new GeneralChatWrapper();
}

/**
 * Plain text → tokens (special-token text is not parsed); BOS prepended when the model asks for it and `addSpecial`.
 * `tokenizer`: the model's own by default; ./token-chunks.ts gives one with the same results, cached.
 */
export function tokenizeText(model: LlamaModel, text: string, addSpecial = true, tokenizer: Tokenizer = model.tokenizer): number[] {
  const toks = tokenizer(text, false) as number[];
  const bos = model.tokens.bos;
  if (addSpecial && bos != null && model.tokens.shouldPrependBosToken && toks[0] !== bos) return [bos, ...toks];
  return toks;
}

/**
 * Messages rendered with `wrapper` — tool calls and results in the history and the functions'
 * documentation in the wrapper's own format (./tools.ts) — the assistant prefix added, tokenized
 * with `tokenizer` (the model's own by default; ./token-chunks.ts gives one with the same results, cached).
 */
export function renderChatTokens(model: LlamaModel, wrapper: ChatWrapper, messages: readonly ChatMessage[], tools?: readonly ToolFunction[], tokenizer: Tokenizer = model.tokenizer): number[] {
  const history = chatHistoryOf(messages);
  const functions = tools && tools.length > 0 ? chatFunctionsOf(tools) : undefined;
  const { contextText } = wrapper.generateContextState({ chatHistory: history, ...(functions ? { availableFunctions: functions, documentFunctionParams: true } : {}) });
  return contextText.tokenize(tokenizer) as number[];
}
