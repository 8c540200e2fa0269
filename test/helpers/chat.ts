/** Chat round helper for the reuse e2e tests: one greedy chat call through the real `openai` client. */
import assert from 'node:assert/strict';
import type OpenAI from 'openai';

export type Msg = OpenAI.Chat.Completions.ChatCompletionMessageParam;

/** One greedy chat round (streamed with a usage chunk, or not): text, prompt tokens, cached tokens. */
export async function chatRound(api: OpenAI, messages: Msg[], stream: boolean, maxTokens = 10): Promise<{ text: string; prompt: number; cached: number }> {
  const common = { model: 'pdserve', messages, max_tokens: maxTokens, temperature: 0 } as const;
  if (stream) {
    const s = await api.chat.completions.create({ ...common, stream: true, stream_options: { include_usage: true } });
    let text = '';
    let usage: OpenAI.CompletionUsage | undefined;
    for await (const ch of s) {
      text += ch.choices[0]?.delta?.content ?? '';
      if (ch.usage) usage = ch.usage;
    }
    assert.ok(usage, 'usage chunk');
    return { text, prompt: usage.prompt_tokens, cached: usage.prompt_tokens_details!.cached_tokens! };
  }
  const r = await api.chat.completions.create(common);
  return { text: r.choices[0]!.message.content ?? '', prompt: r.usage!.prompt_tokens, cached: r.usage!.prompt_tokens_details!.cached_tokens! };
}
