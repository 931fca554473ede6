// A global WebSocket that takes `{headers}` (as Bun's does), for the Open Responses
// compliance suite under node: node 20 has no global WebSocket, and the suite opens its
// sockets with an Authorization header. The `ws` package's client takes the same options.
import { WebSocket } from "ws";

globalThis.WebSocket = WebSocket;
