"""The Remote Workers API's Bots service as a bot calls it (CreateBotSession, UpdateBotSession),
by method path over the worker's gRPC channel, with the retry rules REMOTE-EXEC.md measured on
BuildGrid 0.9.1: UNAVAILABLE is waited out, DEADLINE_EXCEEDED on a long poll is an empty poll,
and a session the server no longer knows (NOT_FOUND, INVALID_ARGUMENT "Bot does not exist") is
made again under the same bot id."""

from __future__ import annotations

import logging
import threading
import time

from build_graph.store.reapi import remoteworkers_pb2 as rw

log = logging.getLogger("bgraph.worker")

_BOTS = "/google.devtools.remoteworkers.v1test2.Bots/"


class SessionGone(Exception):
    """The server dropped this bot's session (expired, or the server restarted): make a new one."""


class Stopped(Exception):
    """The worker is stopping: no further call is made."""


class BotsClient:
    """CreateBotSession / UpdateBotSession for one bot on `channel`, instance `instance`."""

    def __init__(self, channel, instance: str, stopping, poll_s: float = 30.0):
        import grpc

        self.grpc = grpc
        self.instance = instance
        self.stopping = stopping  # a threading.Event: set when the worker stops
        self.poll_s = poll_s
        self._create = channel.unary_unary(_BOTS + "CreateBotSession",
                                           request_serializer=rw.CreateBotSessionRequest.SerializeToString,
                                           response_deserializer=rw.BotSession.FromString)
        self._update = channel.unary_unary(_BOTS + "UpdateBotSession",
                                           request_serializer=rw.UpdateBotSessionRequest.SerializeToString,
                                           response_deserializer=rw.BotSession.FromString)

    def create(self, session: rw.BotSession) -> rw.BotSession:
        """A new session for `session`'s bot id (retried while the server is unavailable or slow)."""
        fresh = rw.BotSession()
        fresh.CopyFrom(session)
        fresh.ClearField("name")
        del fresh.leases[:]
        request = rw.CreateBotSessionRequest(parent=self.instance, bot_session=fresh)
        # The server registers the bot at once but may hold the answer for its long poll (8 s):
        # when the session began is this line's time, not the answer's.
        log.info("bot %s: CreateBotSession", session.bot_id)
        backoff = 0.2
        while True:
            if self.stopping.is_set():
                raise Stopped()
            try:
                return self._interruptible(self._create, request, self.poll_s)
            except self.grpc.RpcError as e:
                code = e.code()
                if code not in (self.grpc.StatusCode.UNAVAILABLE, self.grpc.StatusCode.DEADLINE_EXCEEDED,
                                self.grpc.StatusCode.RESOURCE_EXHAUSTED):
                    raise
                log.info("CreateBotSession: %s, again in %.1f s", code.name, backoff)
            self.stopping.wait(backoff)
            backoff = min(backoff * 2, 5.0)

    def _interruptible(self, method, request, timeout_s: float):
        """`method(request)` as a long poll left (Stopped) as soon as the worker stops; its answer
        is taken the moment it comes (a done-callback wakes the wait, no polling delay)."""
        call = method.future(request, timeout=timeout_s)
        answered = threading.Event()
        call.add_done_callback(lambda _call: answered.set())
        while not answered.wait(0.1):
            if self.stopping.is_set():
                call.cancel()
                raise Stopped()
        return call.result()

    def update(self, session: rw.BotSession, timeout_s: float | None = None,
               interruptible: bool = False) -> rw.BotSession | None:
        """UpdateBotSession: the server's session, or None where the call timed out or the server
        is unavailable (the caller keeps its own and calls again). SessionGone where the server
        no longer knows the session. An `interruptible` call (an idle long poll) is cancelled as
        soon as the worker stops (Stopped), rather than holding its exit for the poll's 8 s."""
        request = rw.UpdateBotSessionRequest(name=session.name, bot_session=session)
        try:
            if not interruptible:
                return self._update(request, timeout=timeout_s or self.poll_s)
            return self._interruptible(self._update, request, timeout_s or self.poll_s)
        except self.grpc.RpcError as e:
            code = e.code()
            if code == self.grpc.StatusCode.DEADLINE_EXCEEDED:
                return None
            if code in (self.grpc.StatusCode.UNAVAILABLE, self.grpc.StatusCode.RESOURCE_EXHAUSTED,
                        self.grpc.StatusCode.CANCELLED):
                log.info("UpdateBotSession: %s", code.name)
                self.stopping.wait(0.5)
                return None
            if code in (self.grpc.StatusCode.NOT_FOUND, self.grpc.StatusCode.INVALID_ARGUMENT):
                raise SessionGone(f"{code.name}: {e.details()}") from None
            raise

    def update_until_sent(self, session: rw.BotSession, give_up_s: float = 600.0) -> rw.BotSession | None:
        """UpdateBotSession retried until the server takes it (a completed lease must reach it);
        None after `give_up_s` (the server then requeues the job when the session expires)."""
        deadline = time.monotonic() + give_up_s
        while True:  # once at least, stopping or not: a worker stopping still hands its lease back
            got = self.update(session, timeout_s=min(self.poll_s, 10.0))
            if got is not None or self.stopping.is_set() or time.monotonic() > deadline:
                return got
