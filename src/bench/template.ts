/**
 * Markdown templates with named placeholders, for reports whose prose a person edits (the
 * template) and whose tables and figures the code computes (the values). A placeholder is
 * `{{name}}` (letters, digits, `_`); one alone on its line is a block and takes its line away when
 * its value is empty.
 */
import { readFileSync } from 'node:fs';

const PLACEHOLDER = /\{\{([A-Za-z0-9_]+)\}\}/g;

/** The placeholder names of `template`, in order of first appearance. */
export function placeholders(template: string): string[] {
  return [...new Set([...template.matchAll(PLACEHOLDER)].map((m) => m[1]!))];
}

/**
 * `template` with every placeholder replaced by its value; runs of blank lines left by empty
 * blocks collapse to one.
 * @throws Error naming every placeholder without a value (unfilled) and every value whose name
 *   the template does not use (unknown: a figure computed and never shown), so a template and its
 *   code cannot drift apart silently.
 */
export function fillTemplate(template: string, values: Readonly<Record<string, string>>): string {
  const names = placeholders(template);
  const unfilled = names.filter((n) => !Object.hasOwn(values, n));
  const unknown = Object.keys(values).filter((n) => !names.includes(n));
  if (unfilled.length || unknown.length)
    throw new Error(`report template: ${[unfilled.length ? `no value for {{${unfilled.join('}}, {{')}}}` : '', unknown.length ? `no placeholder for ${unknown.join(', ')}` : ''].filter(Boolean).join('; ')}`);
  return `${template
    .replace(PLACEHOLDER, (_m, n: string) => values[n]!)
    .replace(/\n{3,}/g, '\n\n')
    .trimEnd()}\n`;
}

/**
 * The text of a template file beside the calling module (`import.meta.url` of the caller): the
 * build copies non-TypeScript files of src/ next to their compiled modules (scripts/build.mjs),
 * so the same URL works from src/ under tsx and from dist/.
 * @throws Error (ENOENT) when the file is missing: a build without the copy step.
 */
export function readTemplate(name: string, base: string | URL): string {
  return readFileSync(new URL(name, base), 'utf8');
}
