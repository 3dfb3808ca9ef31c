"""Seeded scenario families for closed-loop evaluation, built from the world's parts.

Every family but `route` stages one event that a policy blind to the cameras (constant velocity,
the ego-status rollout) drives into unless it reacts, in the spirit of the NHTSA pre-crash
typology (Najm et al. 2007, DOT HS 810 767: lead vehicle stopped / decelerating, pedestrian
crossing, left turn across path, cut-in) that CARLA's scenario runner and Bench2Drive also build on:

- `route`: plain route following with random traffic, like the recorded scenes.
- `lead_brake`: a lead car 15-25 m ahead brakes at ~6 m/s^2 to a stop 1-3 s in, and stays.
- `stopped_vehicle`: a car stands in the ego's lane 20-35 m ahead and drives off after 4-6 s.
- `zebra_crossing`: a pedestrian steps onto the zebra crossing ahead when the ego comes within a distance.
- `jaywalker`: the same mid-block, off any crossing, stepping out beside a parked car that hides them.
- `unprotected_turn`: the ego turns left across oncoming straight traffic that has the right of way.
- `cut_in`: a parked car pulls out of the parking strip into the ego's lane just ahead.

Events that a person triggers fire on the ego's distance, so they happen whatever the policy's speed;
distances are chosen so that the constant-velocity ego meets the actor. Crossing pedestrians do not
yield (that is the point); every other road user follows the normal rules and reacts to the ego.
Held out from training: an evaluation world's generator is seeded with five words
(`[world seed, 0x5EED_D21E, family, index, seed]`) where recorded training scenes use two or three, and the
closed-loop training episodes (`stack.sim.recording`) five with another second word (TRAINING_WORD).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from stack.sim.world.interactive import InteractiveWorld, Routes, Script, place_background
from stack.sim.world.roads import JUNCTION_RADIUS, LANE_WIDTH, ROAD_HALF_WIDTH, arm_frames, make_town
from stack.sim.world.scene import EGO_SIZE
from stack.sim.world.traffic import SIM_DT, SIZES, Agent, Route, _make_route, vehicle_route
from stack.errors import StackError
from stack.pipeline import AGENT_CLASS_MIX, DRIVE_SCENARIOS, WorldConfig

FAMILIES = DRIVE_SCENARIOS
HELD_OUT_WORD = 0x5EED_D21E
TRAINING_WORD = 0x7EA_C4E5
"""Second seed word of closed-loop training episodes: never an evaluation world's (HELD_OUT_WORD)."""
TUNING_WORD = 0x70_E1A6
"""Second seed word of tuning episodes (`drive.split: tuning`): worlds of the same families, neither trained on nor
evaluated on, where settings such as guard.score are chosen without looking at the evaluation episodes."""
SPLIT_WORDS = {"evaluation": HELD_OUT_WORD, "training": TRAINING_WORD, "tuning": TUNING_WORD}
PARKING_OFFSET = (LANE_WIDTH + ROAD_HALF_WIDTH) / 2 + 0.2 - LANE_WIDTH / 2
"""Parking strip centre, right of the lane centre (as recorded scenes park cars), metres."""
ZEBRA_BEFORE_ENTRY = 2.0
"""The zebra crossing's centre lies this far before a route's junction entry (roads.paint_ground)."""


@dataclass(frozen=True)
class EpisodeSpec:
    family: str
    index: int
    seed: int
    duration_s: float = 8.0
    split: str = "evaluation"
    """An evaluation episode (held out), a closed-loop training episode of the same family, or a tuning one
    (SPLIT_WORDS)."""

    @property
    def held_out(self) -> bool:
        return self.split == "evaluation"


def episode_specs(families, episodes: int, seeds, duration_s: float = 8.0, split: str = "evaluation") -> list:
    """Episode i drives family families[i % F] with seed seeds[(i // F) % S], in worlds of `split`."""
    families, seeds = list(families), list(seeds)
    unknown = [f for f in families if f not in FAMILIES]
    if unknown or not families or not seeds:
        raise StackError(f"scenario families {families!r} with seeds {seeds!r}: expected a non-empty list among "
                         f"{', '.join(FAMILIES)} and at least one seed; fix drive.scenarios / drive.seeds")
    if split not in SPLIT_WORDS:
        raise StackError(f"episode split {split!r}: expected one of {', '.join(SPLIT_WORDS)}")
    return [EpisodeSpec(families[i % len(families)], i, int(seeds[(i // len(families)) % len(seeds)]),
                        float(duration_s), split) for i in range(episodes)]


def rng_words(spec: EpisodeSpec, world_config: WorldConfig) -> list:
    """The world generator's seed words: five, so never a recorded scene's ([seed, scene] or [seed, scene, 1]),
    and the second word keeps evaluation and closed-loop training episodes apart."""
    purpose = SPLIT_WORDS[spec.split]
    return [int(world_config.seed), purpose, FAMILIES.index(spec.family), int(spec.index), int(spec.seed)]


def build_world(spec: EpisodeSpec, world_config: WorldConfig, dt: float = SIM_DT) -> InteractiveWorld:
    """The episode's world, a pure function of (spec, world seed, agents per scene, spawn radius, class mix).

    `dt` is the simulation step (1 / drive.sim_hz); the scenario itself (where and when things happen) does
    not depend on it."""
    if spec.family not in FAMILIES:
        raise StackError(f"unknown scenario family {spec.family!r}; choose from {', '.join(FAMILIES)}")
    words = rng_words(spec, world_config)
    rng = np.random.default_rng(words)
    town = make_town(rng)
    routes = Routes(town)
    stage = _BUILDERS[spec.family](town, routes, rng)
    ego = Agent("car", stage.route, stage.ego_s, stage.ego_speed, stage.ego_desired, EGO_SIZE, 0, 0)
    keep_clear = _safe_start(stage.route, stage.ego_s, stage.ego_speed, spec.family)
    background = place_background(routes, ego, world_config.agents_per_scene, rng, world_config.spawn_radius_m,
                                  dict(world_config.class_mix or AGENT_CLASS_MIX), stage.actors,
                                  len(stage.actors) + 1, keep_clear)
    light = np.array([rng.uniform(-math.pi, math.pi), rng.uniform(0.25, 1.1), rng.uniform(0.85, 1.15),
                      rng.uniform(0.92, 1.08), rng.uniform(0.92, 1.08)])
    return InteractiveWorld(town, stage.route, stage.ego_s, stage.ego_speed, stage.ego_desired,
                            stage.actors + background, light, words, stage.scripts, spec.duration_s, dt)


@dataclass
class _Stage:
    route: Route
    ego_s: float
    ego_speed: float
    ego_desired: float
    actors: list
    scripts: tuple = ()


def _ego_start(routes: Routes, rng: np.random.Generator, before_entry: tuple) -> tuple:
    """(route, start arc length, speed, desired speed) of an ego some metres before the junction, cruising."""
    route = routes.random(rng)
    desired = rng.uniform(8.0, 11.0)
    return route, max(route.junction[0] - rng.uniform(*before_entry), 0.0), desired * 0.9, desired


def _size(kind: str, rng: np.random.Generator) -> tuple:
    return tuple(np.array(SIZES[kind]) * rng.uniform(0.92, 1.08, 3))


def _offset_route(route: Route, start_s: float, offset_from: float, blend_m: float) -> Route:
    """The route from `start_s` on, `offset_from` metres to its right at first, blending onto it over `blend_m`."""
    first = int(start_s / (route.length / (len(route.points) - 1)))
    points, headings = route.points[first:], route.headings[first:]
    along = np.arange(len(points)) * (route.length / (len(route.points) - 1))
    x = np.clip(along / max(blend_m, 1e-6), 0.0, 1.0) if math.isfinite(blend_m) else np.zeros(len(points))
    offset = offset_from * (1.0 - x * x * (3.0 - 2.0 * x))  # smoothstep
    right = np.stack([np.sin(headings), -np.cos(headings)], axis=1)
    junction = (route.junction[0] - first * route.length / (len(route.points) - 1),
                route.junction[1] - first * route.length / (len(route.points) - 1))
    return _make_route(points + right * offset[:, None], junction, route.turn, route.entry_arm)


def _crossing(centre: np.ndarray, right: np.ndarray, start: float, end: float) -> Route:
    """A pedestrian path across the road: from `start` metres right of `centre` to `end` metres left of it."""
    return _make_route(np.stack([centre + right * start, centre - right * end]))


def _fair_meet_s(ego_speed: float) -> float:
    """Soonest the constant-velocity ego may meet a pedestrian after they start: 1 s to see, replan (at 2 Hz)
    and build up braking under the jerk limit, the time-equivalent of braking to a stop at 4 m/s^2 (v / 8),
    and 3 m to spare. A pedestrian who steps out closer than that is a collision no driver avoids, and such
    an episode would measure nothing."""
    return 1.0 + ego_speed / 8.0 + 3.0 / max(ego_speed, 1.0)


def _walk_speed(pace: float, start: float, ego_speed: float) -> float:
    """`pace`, capped so the pedestrian is still in the ego's lane at the fair meeting."""
    reach = EGO_SIZE[1] / 2 + SIZES["pedestrian"][1] / 2
    return min(pace, (start + reach) / (_fair_meet_s(ego_speed) + 0.4))


def _crossing_trigger(ego_speed: float, start: float, walk: float, rng: np.random.Generator,
                      lateral_to_ped: float) -> float:
    """Ego-to-pedestrian distance that fires the crossing so a constant-velocity ego meets the pedestrian.

    The pedestrian (`start` metres right of the ego's lane centre) overlaps the ego's lane while its centre
    is within half the widths of the lane centre; the trigger puts the ego's front at the path some way into
    that window, never sooner than a driver who looks could stop (`_fair_meet_s`)."""
    reach = EGO_SIZE[1] / 2 + SIZES["pedestrian"][1] / 2
    enter, leave = (start - reach) / walk, (start + reach) / walk
    meet = max(enter + rng.uniform(0.15, 0.7) * (leave - enter), _fair_meet_s(ego_speed))
    along = ego_speed * meet + EGO_SIZE[0] / 2
    return float(math.hypot(along, lateral_to_ped))


def _route(town, routes, rng) -> _Stage:
    """Like a recorded scene's ego, but at least 30 m before the junction: time to stop if it must yield."""
    route, s, speed, desired = _ego_start(routes, rng, (30.0, 70.0))
    return _Stage(route, s, speed, desired, [])


def _lead_brake(town, routes, rng) -> _Stage:
    route, s, speed, desired = _ego_start(routes, rng, (85.0, 110.0))
    gap = rng.uniform(15.0, 25.0)
    size = _size("car", rng)
    lead = Agent("car", route, s + gap + (EGO_SIZE[0] + size[0]) / 2, speed, speed, size, int(rng.integers(12)), 1)
    script = Script(1, before="rules", after="brake", after_s=float(rng.uniform(1.0, 3.0)),
                    decel=float(rng.uniform(5.5, 6.5)))
    return _Stage(route, s, speed, desired, [lead], (script,))


def _stopped_vehicle(town, routes, rng) -> _Stage:
    route, s, speed, desired = _ego_start(routes, rng, (75.0, 100.0))
    kind = "truck" if rng.random() < 0.25 else "car"
    size = _size(kind, rng)
    ahead = rng.uniform(20.0, 35.0) + (EGO_SIZE[0] + size[0]) / 2
    stopped = Agent(kind, route, s + ahead, 0.0, rng.uniform(7.0, 10.0), size, int(rng.integers(12)), 1)
    script = Script(1, before="hold", after="rules", after_s=float(rng.uniform(4.0, 6.0)))
    return _Stage(route, s, speed, desired, [stopped], (script,))


def _zebra_crossing(town, routes, rng) -> _Stage:
    """The ego starts so that the pedestrian's trigger distance is reached 1-2.5 s into the episode."""
    route = routes.random(rng)
    desired = rng.uniform(8.0, 11.0)
    speed = desired * 0.9
    arm = town.arms[route.entry_arm]
    index = int((JUNCTION_RADIUS + ZEBRA_BEFORE_ENTRY) / (route.length / (len(route.points) - 1)))
    right = arm_frames(arm)[1][index]  # the arm's left normal (outward) is the right of inbound traffic
    lane_centre = arm[index] + right * LANE_WIDTH / 2
    pace = rng.uniform(1.3, 2.0)
    if rng.random() < 0.7:  # from the kerb beside the ego's lane
        start = rng.uniform(4.5, 5.5)
        path = _crossing(lane_centre, right, start, LANE_WIDTH + 5.0)
    else:  # from the far kerb, across the oncoming lane first
        start = ROAD_HALF_WIDTH + LANE_WIDTH / 2 + rng.uniform(0.2, 0.8)
        path = _crossing(lane_centre, -right, start, 5.0)
    walk = _walk_speed(pace, start, speed)
    trigger = _crossing_trigger(speed, start, walk, rng, start)
    along = math.sqrt(max(trigger ** 2 - start ** 2, 0.0)) + speed * rng.uniform(1.0, 2.5)
    s = max(route.junction[0] - ZEBRA_BEFORE_ENTRY - along, 0.0)
    return _Stage(route, s, speed, desired, [_pedestrian(path, walk, rng)],
                  (Script(1, before="hold", after="walk", ego_within_m=trigger, speed=walk),))


def _pedestrian(path: Route, walk: float, rng: np.random.Generator) -> Agent:
    return Agent("pedestrian", path, 0.0, 0.0, walk, _size("pedestrian", rng), int(rng.integers(12)), 1)


def _jaywalker(town, routes, rng) -> _Stage:
    route, s, speed, desired = _ego_start(routes, rng, (90.0, 120.0))
    at = s + rng.uniform(40.0, 60.0)
    centre, heading = route.at(at)
    right = np.array([math.sin(heading), -math.cos(heading)])
    start = rng.uniform(PARKING_OFFSET, ROAD_HALF_WIDTH - LANE_WIDTH / 2 + 0.8)
    walk = _walk_speed(rng.uniform(1.4, 2.4), start, speed)
    path = _crossing(centre, right, start, LANE_WIDTH + 5.0)
    actors = [_pedestrian(path, walk, rng)]
    if rng.random() < 0.6:  # a parked car just before them hides them from the cameras
        size = _size("car", rng)
        strip = _offset_route(route, at - 30.0, PARKING_OFFSET, math.inf)
        actors.append(Agent("car", strip, 30.0 - size[0] / 2 - rng.uniform(0.8, 2.0), 0.0, 0.0, size,
                            int(rng.integers(12)), 2, parked=True))
    trigger = _crossing_trigger(speed, start, walk, rng, start)
    script = Script(1, before="hold", after="walk", ego_within_m=trigger, speed=walk)
    return _Stage(route, s, speed, desired, actors, (script,))


def _cut_in(town, routes, rng) -> _Stage:
    route, s, speed, desired = _ego_start(routes, rng, (85.0, 110.0))
    size = _size("car", rng)
    at = s + rng.uniform(30.0, 45.0)
    blend = rng.uniform(8.0, 12.0)
    path = _offset_route(route, at, PARKING_OFFSET, blend)
    car = Agent("car", path, 0.0, 0.0, rng.uniform(6.0, 9.0), size, int(rng.integers(12)), 1)
    # IDM from standstill (1.5 m/s^2) takes the car ~0.45 of the blend sideways, into the ego's lane, in t_in
    t_in = math.sqrt(2 * 0.45 * blend / 1.5)
    trigger = speed * (t_in + rng.uniform(-0.3, 0.5)) - 0.45 * blend + (EGO_SIZE[0] + size[0]) / 2
    script = Script(1, before="hold", after="rules", ego_within_m=float(trigger))
    return _Stage(route, s, speed, desired, [car], (script,))


def _unprotected_turn(town, routes, rng) -> _Stage:
    """Ego turns left; oncoming straight traffic reaches the conflict point ahead of it, so it has priority."""
    arms = len(town.arms)
    for entry in rng.permutation(arms):
        for exit_ in range(arms):
            if exit_ == entry:
                continue
            route = vehicle_route(town, int(entry), exit_)
            if route.turn != 0:
                continue
            for other in range(arms):
                if other in (entry, exit_):
                    continue
                oncoming = vehicle_route(town, other, int(entry))
                if oncoming.turn == 1:
                    return _turn_stage(route, oncoming, rng)
    return _route(town, routes, rng)  # no left turn across traffic in this town (rare T-junctions)


def _conflict(route: Route, other: Route) -> tuple:
    """Arc lengths (on each) where two routes come closest inside the junction."""
    step_a, step_b = route.length / (len(route.points) - 1), other.length / (len(other.points) - 1)
    a = slice(int(route.junction[0] / step_a), int(route.junction[1] / step_a) + 1)
    b = slice(int(other.junction[0] / step_b), int(other.junction[1] / step_b) + 1)
    distance = np.linalg.norm(route.points[a][:, None] - other.points[b][None], axis=2)
    i, j = np.unravel_index(int(np.argmin(distance)), distance.shape)
    return (a.start + i) * step_a, (b.start + j) * step_b


def _turn_stage(route: Route, oncoming: Route, rng: np.random.Generator) -> _Stage:
    desired = rng.uniform(8.0, 11.0)
    speed = desired * 0.9
    conflict_ego, conflict_other = _conflict(route, oncoming)
    ego_s = max(conflict_ego - rng.uniform(30.0, 45.0), 0.0)
    arrive = (conflict_ego - ego_s) / speed
    actors = []
    first = arrive + rng.uniform(-0.8, 0.2)
    for k, when in enumerate((first, first + rng.uniform(1.8, 2.6))):
        size = _size("car", rng)
        v = rng.uniform(8.0, 10.0)
        s = conflict_other - v * when
        if s > 0:
            actors.append(Agent("car", oncoming, s, v, v, size, int(rng.integers(12)), len(actors) + 1))
    return _Stage(route, ego_s, speed, desired, actors)


def _clear_ahead(route: Route, ego_s: float, junction: bool = False):
    """Spawn filter: no moving vehicle in the ego's corridor for 70 m ahead (the scenario's actor is the event),
    and with `junction`, none in the junction or less than 40 m before it (the oncoming cars are the event)."""
    step = route.length / (len(route.points) - 1)
    corridor = route.points[int(max(ego_s - 5.0, 0) / step):int(min(ego_s + 70.0, route.length) / step)]

    def keep(agent: Agent) -> bool:
        if agent.parked or agent.kind == "pedestrian":
            return True
        if junction and agent.s > agent.route.junction[0] - 40.0:
            return False
        xy, _ = agent.route.at(agent.s)
        return bool(np.min(np.linalg.norm(corridor - xy, axis=1)) > 3.0)

    return keep


def _safe_start(route: Route, ego_s: float, ego_speed: float, family: str):
    """Spawn filter of every family: no road user the ego could not stop for comfortably from its start.

    Recorded scenes need no such rule (their expert brakes without limits); in closed loop a slow cyclist
    spawned a few metres ahead of the cruising ego would be a collision no policy can avoid. A vehicle in the
    ego's corridor must be ahead by the ego's 1.5 s headway plus the distance to match its speed at 3 m/s^2."""
    step = route.length / (len(route.points) - 1)
    scenario = None if family == "route" else _clear_ahead(route, ego_s, family == "unprotected_turn")

    def keep(agent: Agent) -> bool:
        if scenario is not None and not scenario(agent):
            return False
        if agent.parked or agent.kind == "pedestrian":
            return True
        speed = agent.speed if math.cos(agent.route.at(agent.s)[1] - route.at(ego_s)[1]) > 0.5 else 0.0
        reach = 1.5 * ego_speed + max(ego_speed ** 2 - speed ** 2, 0.0) / (2 * 3.0) + 8.0
        corridor = route.points[int(max(ego_s - 6.0, 0) / step):int(min(ego_s + reach, route.length) / step) + 1]
        xy, _ = agent.route.at(agent.s)
        return not len(corridor) or bool(np.min(np.linalg.norm(corridor - xy, axis=1)) > 2.5)

    return keep


_BUILDERS = {"route": _route, "lead_brake": _lead_brake, "stopped_vehicle": _stopped_vehicle,
             "zebra_crossing": _zebra_crossing, "jaywalker": _jaywalker, "unprotected_turn": _unprotected_turn,
             "cut_in": _cut_in}
