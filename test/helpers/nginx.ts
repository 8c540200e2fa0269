/**
 * The throwaway nginx of the tests: src/up/nginx.ts (OPERATIONS.md's config on a free loopback
 * port). `nginxBinary()` is null when nginx is not installed; tests then say so loudly and skip.
 */
export { nginxBinary, nginxSite, startNginx, type LocalNginx as TestNginx } from '../../src/up/nginx.js';
