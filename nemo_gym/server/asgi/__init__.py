"""The ASGI plumbing every server of ours runs each request through.

Contract
--------
* :class:`ServerLayer` (:mod:`nemo_gym.server.asgi.layer`) is ONE pure-ASGI layer doing, in this order: the
  run-token check and the request-body limit (:class:`nemo_gym.auth.RequestGuard`'s rules), the
  ``/ng-rollout/<id>`` path prefix (:mod:`nemo_gym.server.rollout_prefix`), the signed per-instance
  session cookie (:mod:`nemo_gym.server.asgi.sessions`) and JSON answers for unhandled errors, with every
  error answer scrubbed of known secrets (:mod:`nemo_gym.server.asgi.errors`). One layer with one ``send``
  wrapper instead of four stacked ones: the per-request cost is what throughput is measured against.
* The separate middlewares (:class:`SessionMiddleware`, :class:`InternalErrorMiddleware`,
  ``RequestGuard``, ``RolloutContextMiddleware``) stay, with the same behaviour, for apps that install
  them one by one (upstream's ``setup_session_middleware`` pattern, the head server).
"""

from nemo_gym.server.asgi.errors import InternalErrorMiddleware as InternalErrorMiddleware
from nemo_gym.server.asgi.layer import ServerLayer as ServerLayer
from nemo_gym.server.asgi.sessions import SESSION_ID_KEY as SESSION_ID_KEY
from nemo_gym.server.asgi.sessions import SessionMiddleware as SessionMiddleware
from nemo_gym.server.asgi.sessions import cookie_name_for as cookie_name_for
