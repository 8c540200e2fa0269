export * from '@openai/agents';
export { z } from 'zod';
