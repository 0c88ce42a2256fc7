"""The router: one HTTP front for many serving instances (``fastdeploy router``).

Instances (``fastdeploy serve --router HOST:PORT``) register and heartbeat with a signed
``POST /register``; the router proxies the OpenAI routes to one of them, picked by a policy
(:mod:`.policies`), and in splitwise mode pairs a prefill instance with a decode instance per
request. It imports nothing from the engine: it knows instances only by what they registered
and by the requests it has in flight with them.

Rooms: :mod:`.instances` (what an instance registered, its load, heartbeat expiry),
:mod:`.policies` (choosing one), :mod:`.security` (the shared secret and its signatures),
:mod:`.app` (the HTTP routes and the proxy), :mod:`.registration` (the instance side: register
and heartbeat), :mod:`.cli` (the command).
"""
