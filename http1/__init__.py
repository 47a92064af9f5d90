"""The HTTP/1.1 server core shared by the fleet's public server (fleet/http_server.py) and the
coordinator's API server (coordinator/http.py): httptools (llhttp) parsing on asyncio protocols.

Why our own core and not aiohttp's server: on this project's 2-core box a route that reads a small
JSON body and answers a fixed one costs ~48 µs of CPU through aiohttp and ~13 µs through a bare
httptools protocol (bench/results/history/fleet.md, "fleet CPU per request · lean HTTP server"); the coordinator's
`/finish` ~50 µs against ~11-17 µs (bench/coordinator/coordinator.py, "HTTP floor").

What the two servers share lives here, once: the answer's wire bytes (`wire`: status lines, the
`Date` header rendered once a second, a complete answer's head), and the connection plumbing
(`conn`: TCP_NODELAY, back-pressure with a drain future, idle tracking, the listening sockets, the
keep-alive sweep and the bounded shutdown). What differs stays with each server: the fleet runs an
async task per request and streams its answers; the coordinator answers synchronously when a
request's body is complete and can hand a connection over to its channel.

Imports nothing of ours: a package under every server.
"""
