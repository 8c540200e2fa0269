/** Throwaway TLS material for tests: see src/up/test-pki.ts. */
export { makeTestPki, type TestPki } from '../../src/up/test-pki.js';
