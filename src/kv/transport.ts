/**
 * The KV channel's socket seam: how a listener and a dial are made, plain TCP (node:net) or TLS
 * (node:tls, mutual when a CA is given). KvServer and KvPeerPool (channel.ts) get their sockets
 * only from a KvTransport, so the frame, handshake and transfer code above never knows which it
 * has: a TLSSocket is a net.Socket.
 *
 * With TLS the channel's own HMAC challenge (handshake.ts) still runs inside the TLS session:
 * TLS authenticates the hosts' certificates and encrypts, the challenge proves the cluster
 * secret and binds the session epoch.
 */
import net from 'node:net';
import tls from 'node:tls';

/** What a dial needs: the address, its deadline, and net's `onread` (one reused read buffer). */
export interface KvDialOptions {
  host: string;
  port: number;
  onread?: net.OnReadOpts;
}

/** One dial: the socket, and the event that says it is ready to carry frames. */
export interface KvDial {
  socket: net.Socket;
  /** 'connect' (TCP) or 'secureConnect' (TLS: the handshake, peer verification included, is done). */
  readyEvent: 'connect' | 'secureConnect';
}

/** Makes the KV channel's sockets. */
export interface KvTransport {
  /** 'tcp' or 'tls' (logs, /health). */
  readonly kind: 'tcp' | 'tls';
  /**
   * A server that calls `onSocket` with each accepted connection ready to carry frames (for TLS:
   * after the handshake); `onRefused` with why a TLS handshake failed (no or a wrong client
   * certificate, not TLS at all; `hangUp`: the peer reset the connection mid-handshake, as a
   * killed peer does, or as OpenSSL reports some refusals), the socket already destroyed.
   */
  createServer(onSocket: (sock: net.Socket) => void, onRefused: (why: string, address: string, hangUp: boolean) => void): net.Server;
  /** Start a dial (the caller waits for `readyEvent`, 'error' or 'close', with its own deadline). */
  dial(o: KvDialOptions): KvDial;
}

/** Plain TCP: the default. */
export const tcpTransport: KvTransport = {
  kind: 'tcp',
  createServer: (onSocket) => net.createServer({ noDelay: true }, onSocket),
  dial: (o) => ({ socket: net.connect({ host: o.host, port: o.port, noDelay: true, ...(o.onread ? { onread: o.onread } : {}) }), readyEvent: 'connect' }),
};

/** TLS material of both ends (PEM bytes; see ../security/tls.ts `loadInternalTls`). */
export interface KvTlsOptions {
  /** This end's certificate and key: required on the server; on the client, its client certificate. */
  cert?: Buffer;
  key?: Buffer;
  /** The CA of the peers' certificates: the client verifies the server with it; a server with it requires client certificates it signed. */
  ca?: Buffer;
  /** Server: deadline of the TLS handshake, ms (default 2000). */
  handshakeTimeoutMs?: number;
}

/**
 * TLS sockets (node:tls). The server verifies client certificates when `ca` is given (mutual
 * TLS) and refuses a client without one in the handshake; the client always verifies the
 * server's certificate (against `ca`, else the system store), its name against the dialed host.
 * @throws TypeError when the server side lacks a certificate or key (at createServer).
 */
export function tlsTransport(t: KvTlsOptions): KvTransport {
  return {
    kind: 'tls',
    createServer(onSocket, onRefused) {
      if (!t.cert || !t.key) throw new TypeError('KV channel over TLS: the server needs a certificate and a key');
      const server = tls.createServer({ cert: t.cert, key: t.key, ...(t.ca ? { ca: t.ca } : {}), requestCert: t.ca !== undefined, rejectUnauthorized: t.ca !== undefined, handshakeTimeout: t.handshakeTimeoutMs ?? 2000 }, (sock) => {
        sock.setNoDelay(true);
        onSocket(sock);
      });
      server.on('tlsClientError', (err: NodeJS.ErrnoException, sock) => onRefused(err.message, `${sock.remoteAddress ?? '?'}:${sock.remotePort ?? '?'}`, err.code === 'ECONNRESET'));
      return server;
    },
    dial(o) {
      const socket = tls.connect({ host: o.host, port: o.port, ...(t.ca ? { ca: t.ca } : {}), ...(t.cert && t.key ? { cert: t.cert, key: t.key } : {}), ...(net.isIP(o.host) ? {} : { servername: o.host }), ...(o.onread ? { onread: o.onread } : {}) });
      socket.setNoDelay(true);
      return { socket, readyEvent: 'secureConnect' };
    },
  };
}

/** TLS when `t` is given (./transport.ts `tlsTransport`), else plain TCP. */
export function kvTransportOf(t: KvTlsOptions | undefined): KvTransport {
  return t ? tlsTransport(t) : tcpTransport;
}
