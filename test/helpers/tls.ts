/** Throwaway TLS material for tests: see src/harness/test-pki.ts. */
export { makeTestPki, type TestPki } from '../../src/harness/test-pki.js';
