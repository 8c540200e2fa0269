/** The options a real `pdserve` subcommand parses from `args` (commander, no process started). */
import assert from 'node:assert/strict';
import type { Command } from 'commander';
import { cliProgram } from '../../src/cli/main.js';

/** `pdserve <name> <args…>`'s parsed options; asserts that every argument was known to it. */
export async function parsedOptions(name: string, args: string[]): Promise<Record<string, unknown>> {
  const program = await cliProgram(['node', 'pdserve']);
  const cmd = program.commands.find((c) => c.name() === name) as Command;
  const { unknown } = cmd.parseOptions(args);
  assert.deepEqual(unknown, [], `${name} refuses ${unknown.join(' ')}`);
  return cmd.opts();
}
