/**
 * When a worker switching role may tear down its role's parts (../switch/host.ts, and the
 * simulator's switches: ../sim/world.ts): no work request in flight AND no live room. The rooms
 * count on their own: a prefill room whose KV a decode still reads, or one a decode's REGISTER
 * created before the router's request arrived, has no request in flight on this worker.
 */
export interface SwitchDrainState {
  /** Work requests (POST /generate) whose response has not closed. */
  inflight: number;
  /** Rooms of the role's table that are not terminal, and decode jobs still holding a slot. */
  liveRooms: number;
}

/** True when the switch may tear down (see the module doc). */
export function drainedForSwitch(s: SwitchDrainState): boolean {
  return s.inflight === 0 && s.liveRooms === 0;
}
