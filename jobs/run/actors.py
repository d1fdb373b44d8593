"""The job's engine actors: placed, started, and followed while nodes come and go.

Ray restarts a dead actor (`max_restarts = ray.max_restarts`) but does not retry its calls
(`max_task_retries = 0`): a call on an actor that went away fails, and the dispatcher hands the shard on
itself, so every retry is one it counted. An actor whose call failed is *lost*; the pool asks it (`info`)
until it answers:

- Ray calls an actor on a node it has not yet marked dead (~15 s of missed health checks) *unavailable*;
  the pool asks again every second. A lost node's actor is then restarted wherever its placement-group
  bundle fits again, and the answer comes from there.
- The answer tells a restart (another process: one death) from a blip (the same process: nothing counted).
- An actor Ray will not restart (two asks in a row fail with ActorDiedError: an ask waits for a restart
  that is coming) is dead. One that is not back within ray.placement_timeout_s (its node lost and no room
  elsewhere) is given up and killed. The job goes on while any actor is live or may come back.
- A live actor holding rows is asked how many engine passes it has finished (`passes`) every few seconds. One
  that has finished none for ray.stall_timeout_s (a hung kernel or device; an actor too busy to answer counts
  the same) has *stalled*: it is killed for Ray to restart, and is lost as if it had died.
- A death the dispatcher charges to a row (`isolation`: the actor ran a suspect piece alone) does not count toward
  ray.max_restarts. Ray counted it all the same, so an actor whose Ray restarts went on such deaths is replaced,
  when Ray will not restart it, by a new actor in its place with the restarts it has left.

The log names each actor's node at start and at every loss and return.
"""
from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from omegaconf import DictConfig

from .cluster import ClusterError, HeadWatch, Resources
from .isolation import Work
from .worker import ShardWorker, WorkerSpec

log = logging.getLogger("esp_batch")

STARTING, LIVE, LOST, GONE = "starting", "live", "lost", "gone"
_ASK_AGAIN_S = 1.0  # between asks of an actor Ray calls unavailable
_BEAT_EVERY_S = 10.0  # between asks of a live actor's engine passes (at most a quarter of ray.stall_timeout_s)


class StartError(RuntimeError):
    """No engine could start (the engine failed to load, or every actor was lost); one-line message."""


@dataclass
class Place:
    """Where an actor process runs."""

    node_id: str
    ip: str
    pid: int

    def __str__(self) -> str:
        return f"node {self.node_id[:8]} ({self.ip})" if self.node_id else f"pid {self.pid}"


@dataclass
class Actor:
    index: int
    handle: Any  # the Ray actor handle
    state: str = STARTING  # starting | live | lost | gone
    place: Optional[Place] = None  # where it last answered from
    load: int = 0  # shards in flight on it
    deaths: int = 0  # deaths seen that count toward ray.max_restarts
    charged: int = 0  # deaths seen that were charged to a row it ran alone (`isolation`)
    charged_here: int = 0  # of those, the ones Ray restarted this handle for (they used its Ray restarts)
    renewed: bool = False  # a new handle took the dead one's place and has not answered yet
    lost_at: float = 0.0  # time.monotonic() of the loss
    held: list[Work] = field(default_factory=list)  # shards (or pieces) in flight on it when it was lost
    ask: Any = None  # the `info` call in flight
    ask_at: float = 0.0  # when to ask next
    died_answers: int = 0  # asks in a row answered by ActorDiedError
    beat: Any = None  # the `passes` call in flight (live actors)
    beat_at: float = 0.0  # when to send the next
    passes: int = -1  # its engine's passes at the last answer
    progress_at: float = 0.0  # when it was last seen idle or with more passes than before
    stalled: str = ""  # why it was killed as stalled (one line), until it is back
    end: str = ""  # why it is gone (one line)
    error: str = ""  # the error of its last loss (one line)
    info: dict[str, Any] = field(default_factory=dict)  # its last `info` answer


def actor_error_text(exc: BaseException, limit: int = 160) -> str:
    """The informative line of a Ray actor error: Ray's first line is generic, the cause follows its
    tab-indented details (class, id, pid, ip)."""
    text = str(getattr(exc, "error_msg", None) or exc)
    for boilerplate in (r"The actor [0-9a-f]+ is unavailable: ", r"The actor is temporarily unavailable: ",
                        r"\s*The task may or may not have been executed on the actor\."):
        text = re.sub(boilerplate, "", text)
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("\t")]
    generic = "The actor died unexpectedly before finishing this task."
    useful = [ln for ln in lines if ln != generic] or lines or [type(exc).__name__]
    text = f"{type(exc).__name__}: {' '.join(useful)}"
    return text if len(text) <= limit else text[:limit].rsplit(" ", 1)[0] + " ..."


class ActorPool:
    """`n` ShardWorker actors in one placement group (one bundle each), and what became of each."""

    def __init__(self, cfg: DictConfig, spec: WorkerSpec, n: int, cap: int, resources: Resources, head: HeadWatch):
        self.cfg = cfg
        self.spec = spec
        self.n = n
        self.cap = cap  # run_shard calls per actor at once
        self.resources = resources
        self.head = head
        self.timeout_s = float(cfg.ray.placement_timeout_s)
        self.max_restarts = int(cfg.ray.max_restarts)
        self.stall_timeout_s = float(cfg.ray.stall_timeout_s)
        self.beat_every_s = min(_BEAT_EVERY_S, max(0.5, self.stall_timeout_s / 4))
        self.note_every_s = float(cfg.output.progress_interval_s)
        self.actors: list[Actor] = []
        self.pg: Any = None
        # the dispatcher: an actor died holding this work; True when the death is charged to a row it ran alone
        self.on_death: Callable[[Actor, list[Work]], bool] = lambda actor, held: False
        self._noted = time.monotonic()
        self.graph_records: list[dict[str, Any]] = []  # the actors' engine.cuda_graphs counters (`batch_histogram`)
        self.engine_errors = 0  # batches whose engine raised, their rows run again in halves (`batch_histogram`)
        # the live actors' engine time summed (`batch_histogram`): prefill forwards and seconds, decode seconds
        self.engine_time: dict[str, float] = {}

    # ---- start and stop ------------------------------------------------------------------------------
    def start(self) -> None:
        """Place the bundles, start the actors and wait until each has loaded its engine (or is gone).
        Raises ClusterError (no room within ray.placement_timeout_s), HeadLost or StartError."""
        self.pg = self._place()
        for i in range(self.n):
            actor = Actor(i, self._spawn(i, self.max_restarts))
            self.actors.append(actor)
            self._ask(actor)
        while any(a.state in (STARTING, LOST) for a in self.actors):
            self.wait([], 1.0)
        bad = next((a.info["error"] for a in self.actors if a.info.get("error")), None)
        if not bad and not self.live():
            self.head.confirm("no engine actor started")
        if bad or not self.live():
            self.stop()
            raise StartError(f"the engine failed to load: {bad}" if bad else self.none_left())
        info = self.live()[0].info
        log.info("%d actor(s) ready (%s each%s), %d shards in flight each (engine on %s, max_context %s, chat "
                 "template %s): %s", len(self.live()), self.resources,
                 f"; {self.resources.note}" if self.resources.note else "", self.cap, info.get("device", "?"),
                 info["max_context"], "on" if info["chat_template"] else "off",
                 ", ".join(f"actor {a.index} on {a.place}" for a in self.live()))

    def _spawn(self, index: int, max_restarts: int) -> Any:
        """A ShardWorker actor in bundle `index` that Ray restarts up to max_restarts times."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        options = dict(num_cpus=self.resources.cpus, num_gpus=self.resources.gpus, max_restarts=max_restarts,
                       max_task_retries=0, max_concurrency=self.cap + 2)  # cap run_shard calls + info/stats
        where = {} if self.pg is None else {"scheduling_strategy": PlacementGroupSchedulingStrategy(
            self.pg, placement_group_bundle_index=index)}
        return ray.remote(ShardWorker).options(**options, **where).remote(self.spec)

    def _place(self) -> Any:
        """A placement group holding the n actor bundles, or None when actors ask for no resources. Raises
        ClusterError when the cluster cannot place them within ray.placement_timeout_s."""
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group

        bundle = self.resources.bundle()
        if not bundle:
            return None
        pg = placement_group([bundle] * self.n, strategy="PACK")
        ready = pg.ready()
        t0 = time.monotonic()
        while not ray.wait([ready], timeout=1.0)[0]:
            self.head.check()
            waited = time.monotonic() - t0
            if waited >= self.timeout_s:
                remove_placement_group(pg)
                raise ClusterError(
                    f"the cluster could not place {self.n} actors x ({self.resources}) within ray.placement_timeout_s="
                    f"{self.timeout_s:g}s (available: {self._free()}); lower ray.num_actors or the per-actor "
                    "resources, or add nodes")
            self._note(lambda: f"waiting for the cluster to place {self.n} actors x ({self.resources}) ({waited:.0f}s "
                               f"of ray.placement_timeout_s={self.timeout_s:g}s; available: {self._free()})")
        return pg

    def stop(self) -> None:
        """Kill the actors and give their placement group's resources back to the cluster."""
        from ray.util.placement_group import remove_placement_group

        for a in self.actors:
            if a.state != GONE:
                _kill(a.handle)
            a.state, a.ask = GONE, None
        if self.pg is not None:
            remove_placement_group(self.pg)
            self.pg = None

    # ---- state ---------------------------------------------------------------------------------------
    def live(self) -> list[Actor]:
        return [a for a in self.actors if a.state == LIVE]

    @property
    def any_left(self) -> bool:
        """Whether any actor is live or may come back."""
        return any(a.state != GONE for a in self.actors)

    def none_left(self) -> str:
        """One line: why no actor is left."""
        gone = [a for a in self.actors if a.state == GONE and a.end]
        if not gone:
            return "no engine actor is left"
        more = f" ({len(gone) - 1} other actor(s) gone before)" if len(gone) > 1 else ""
        return f"no engine actor is left: {gone[-1].end}{more}"

    def batch_histogram(self) -> dict[int, int]:
        """Sum of the live actors' engine batch-size histograms (an actor that restarted lost its own)."""
        import collections

        import ray

        total: collections.Counter[int] = collections.Counter()
        self.graph_records, self.engine_errors, self.engine_time = [], 0, collections.Counter()
        asks = {a.handle.stats.remote(): a for a in self.live()}
        ready, _ = ray.wait(list(asks), num_returns=len(asks), timeout=30) if asks else ([], [])
        for ref, a in asks.items():
            try:
                if ref not in ready:
                    raise TimeoutError
                stats = ray.get(ref)
                total.update({int(k): v for k, v in stats["batch_histogram"].items()})
                if stats.get("cuda_graphs"):
                    self.graph_records.append(stats["cuda_graphs"])
                self.engine_errors += stats["engine_errors"]
                self.engine_time.update(stats.get("engine_time", {}))
            except Exception:  # noqa: BLE001 - statistics only
                log.warning("could not read actor %d's batch statistics", a.index)
        return dict(sorted(total.items()))

    def cuda_graphs(self) -> Optional[dict[str, Any]]:
        """The live actors' engine.cuda_graphs counters summed (read by `batch_histogram`); None when no engine had
        graphs. Capture seconds are part of each actor's start-up."""
        import collections

        records = self.graph_records
        if not records:
            return None
        eager: collections.Counter[str] = collections.Counter()
        for r in records:
            eager.update(r["eager_passes"])
        return {"actors": len(records), "captured": sum(r["captured"] for r in records),
                "capture_s": round(sum(r["capture_s"] for r in records), 3),
                "graph_mb": round(sum(r["graph_bytes"] for r in records) / 2**20, 1),
                "graph_passes": sum(r["graph_passes"] for r in records),
                "ahead_passes": sum(r.get("ahead_passes", 0) for r in records),
                "probe_passes": sum(r.get("probe_passes", 0) for r in records),
                "kept_ended_passes": sum(r.get("kept_ended_passes", 0) for r in records), "eager_passes": dict(eager)}

    # ---- waiting -------------------------------------------------------------------------------------
    def wait(self, refs: list[Any], timeout: float) -> list[Any]:
        """Up to `timeout` seconds for one of `refs` (calls on the actors) to finish, answering the asks of
        lost actors meanwhile. Returns the finished refs (at most one). Raises HeadLost."""
        import ray

        self.head.check()
        self._tick()
        asks = {a.ask: a for a in self.actors if a.ask is not None}
        beats = {a.beat: a for a in self.actors if a.beat is not None}
        pending = [*refs, *asks, *beats]
        if not pending:  # only lost actors between two asks
            time.sleep(timeout)
            return []
        ready, _ = ray.wait(pending, num_returns=1, timeout=timeout)
        done = []
        for ref in ready:
            if ref in asks:
                self._answer(asks[ref], ref)
            elif ref in beats:
                self._beat(beats[ref], ref)
            else:
                done.append(ref)
        return done

    def lose(self, actor: Actor, exc: BaseException, held: list[Work]) -> None:
        """A call on `actor` failed with a RayActorError while it held `held`: it is lost until an ask is
        answered."""
        if actor.state == LOST:
            have = {w.piece for w in actor.held}
            actor.held += [w for w in held if w.piece not in have]
            return
        if actor.state == GONE:
            return
        actor.state, actor.lost_at, actor.held = LOST, time.monotonic(), list(held)
        actor.error, actor.beat = actor.stalled or actor_error_text(exc), None
        if actor.ask is None:
            self._ask(actor)
        where = f"on {actor.place}" if actor.place else "during start-up"
        shards = ""
        if held:
            to = "the live actors" if self.live() else "it when it is back (no other actor is live)"
            shards = f"; its {len(held)} shard(s) [{', '.join(str(w.piece) for w in held)}] go to {to}"
        log.warning("actor %d lost %s: %s%s", actor.index, where, actor.error, shards)

    def _ask(self, actor: Actor) -> None:
        actor.ask = actor.handle.info.remote()

    def _answer(self, actor: Actor, ref: Any) -> None:
        import ray
        from ray.exceptions import ActorUnavailableError, RayActorError

        actor.ask = None
        if actor.state == GONE:
            return
        try:
            info = ray.get(ref)
        except ActorUnavailableError as exc:  # its node is not marked dead yet, or a blip: ask again soon
            self.lose(actor, exc, [])
            actor.died_answers, actor.ask_at = 0, time.monotonic() + _ASK_AGAIN_S
            return
        except RayActorError as exc:  # it died: ask again at once; the ask waits for the restart, if any
            self.lose(actor, exc, [])
            actor.died_answers += 1
            if actor.died_answers >= 2:
                self._dead(actor, exc)
            return
        actor.died_answers = 0
        place = Place(info.get("node_id", ""), info.get("ip", ""), int(info.get("pid", 0)))
        previous, actor.place, actor.info = actor.place, place, info
        if info.get("error"):
            reason = f"actor {actor.index} on {place} could not load its engine: {info['error']}"
            if actor.state == STARTING:  # start() stops the job with this one line
                actor.state, actor.end = GONE, reason
            else:
                self._gone(actor, reason, died=True)
            return
        actor.progress_at, actor.passes, actor.stalled = time.monotonic(), -1, ""
        if actor.state == STARTING:
            actor.state = LIVE
            return
        restarted = previous is None or (previous.node_id, previous.pid) != (place.node_id, place.pid)
        held, actor.held = actor.held, []
        actor.state = LIVE
        away = time.monotonic() - actor.lost_at
        if actor.renewed:
            actor.renewed = False
            log.info("actor %d started again on %s after %.0fs", actor.index, place, away)
        elif restarted:
            if self.on_death(actor, held):
                actor.charged, actor.charged_here = actor.charged + 1, actor.charged_here + 1
                log.info("actor %d back on %s after %.0fs: restarted (charged to the row it ran alone, not to "
                         "ray.max_restarts=%d: %d used)", actor.index, place, away, self.max_restarts, actor.deaths)
            else:
                actor.deaths += 1
                log.info("actor %d back on %s after %.0fs: restarted (%d of ray.max_restarts=%d)", actor.index, place,
                         away, actor.deaths, self.max_restarts)
        else:
            log.info("actor %d back on %s after %.0fs (the same process: not a restart)", actor.index, place, away)

    def _dead(self, actor: Actor, exc: BaseException) -> None:
        """Ray will not restart `actor`: it is gone, unless Ray's restarts went on deaths charged to rows (this one,
        or earlier ones on this handle) and ray.max_restarts still allows one; then a new actor takes its place."""
        held, actor.held = actor.held, []
        charged = self.on_death(actor, held)
        deaths = actor.deaths + (0 if charged else 1)
        if (charged or actor.charged_here) and deaths <= self.max_restarts:
            actor.deaths, actor.charged = deaths, actor.charged + charged
            _kill(actor.handle)
            actor.handle, actor.charged_here = self._spawn(actor.index, self.max_restarts - deaths), 0
            actor.renewed, actor.died_answers, actor.lost_at = True, 0, time.monotonic()
            log.warning("actor %d is dead and Ray will not restart it, but %d of its deaths were charged to rows that kill "
                        "the engine: a new actor takes its place (%d of ray.max_restarts=%d used)",
                        actor.index, actor.charged, deaths, self.max_restarts)
            self._ask(actor)
            return
        self._gone(actor, f"actor {actor.index} (last on {actor.place or 'no node yet'}) is dead and Ray will not "
                          f"restart it (ray.max_restarts={self.max_restarts}; {actor.deaths + 1} death(s) seen): "
                          f"{actor_error_text(exc)}", died=False)

    def _beat(self, actor: Actor, ref: Any) -> None:
        """A live actor said how many engine passes it has finished: more than before is progress."""
        import ray

        actor.beat = None
        try:
            passes = ray.get(ref)
        except Exception:  # noqa: BLE001 - a lost actor: its shards' calls say so
            return
        if passes != actor.passes:
            actor.passes, actor.progress_at = passes, time.monotonic()

    def _watch(self, now: float) -> None:
        """Ask live actors holding rows for their engine passes; kill one that has finished none for
        ray.stall_timeout_s, for Ray to restart it (its shards' calls then fail, and it is lost)."""
        if self.stall_timeout_s <= 0:
            return
        for a in self.live():
            if a.load == 0 or a.stalled:  # idle: nothing to stall on
                a.progress_at = now
                continue
            if now - a.progress_at >= self.stall_timeout_s:
                a.stalled = (f"its engine finished no pass for {now - a.progress_at:.0f}s while it held rows "
                             f"(ray.stall_timeout_s={self.stall_timeout_s:g}): killed, for Ray to restart it")
                log.error("actor %d on %s: %s", a.index, a.place, a.stalled)
                _kill(a.handle, restart=True)  # its shards' calls then fail, and it is lost
            elif a.beat is None and now >= a.beat_at:
                a.beat, a.beat_at = a.handle.passes.remote(), now + self.beat_every_s

    def _tick(self) -> None:
        """Watch the live actors for stalls; ask lost actors again when due; give up those lost longer than
        ray.placement_timeout_s; say what the job waits for."""
        now = time.monotonic()
        self._watch(now)
        for a in self.actors:
            if a.state != LOST:
                continue
            if now - a.lost_at >= self.timeout_s:
                self._gone(a, f"actor {a.index} lost {f'with {a.place}' if a.place else 'during start-up'} was not "
                              f"back within ray.placement_timeout_s={self.timeout_s:g}s (it needs {self.resources}; "
                              f"the cluster has {self._free()})", died=True)
            elif a.ask is None and now >= a.ask_at:
                self._ask(a)
        lost = [a for a in self.actors if a.state == LOST]
        starting = [a.index for a in self.actors if a.state == STARTING]
        if lost:
            self._note(lambda: "waiting for " + "; ".join(
                f"actor {a.index} (lost {f'with {a.place}' if a.place else 'during start-up'} {now - a.lost_at:.0f}s "
                f"ago; given up after ray.placement_timeout_s={self.timeout_s:g}s)" for a in lost))
        elif starting:
            self._note(lambda: f"waiting for actor(s) {', '.join(map(str, starting))} to start (placing, loading "
                               "the engine)")

    def _gone(self, actor: Actor, reason: str, died: bool) -> None:
        held = actor.held
        actor.state, actor.end, actor.ask, actor.held = GONE, reason, None, []
        if not self.head.down:  # ray.kill goes through the GCS
            _kill(actor.handle)
        rest = "its shards go to the live actors" if self.any_left else "no engine actor is left"
        log.error("%s; %s", reason, rest)
        if died:
            self.on_death(actor, held)

    def _free(self) -> str:
        """The cluster's free resources of the kinds an actor needs (a GCS call: not while the head is silent)."""
        import ray

        if self.head.down:
            return "unknown: the cluster's head does not answer"
        try:
            have, free = ray.cluster_resources(), ray.available_resources()
        except Exception:  # noqa: BLE001 - for the message only
            return "unknown"
        return ", ".join(f"{k} {free.get(k, 0):g} free of {have.get(k, 0):g}" for k in self.resources.bundle()) or "-"

    def _note(self, text: Callable[[], str]) -> None:
        """A 'waiting for ...' line, at most every output.progress_interval_s."""
        now = time.monotonic()
        if now - self._noted >= self.note_every_s:
            self._noted = now
            log.info("%s", text())


def _kill(handle: Any, restart: bool = False) -> None:
    """End the actor's process; with `restart`, for Ray to start it again (within its max_restarts)."""
    import ray

    try:
        ray.kill(handle, no_restart=not restart)
    except Exception:  # noqa: BLE001 - already dead, or the cluster is going away
        pass
