/**
 * A worker's GET /debug/rooms as it crosses HTTP: the room lifecycle's rows
 * (../kv/lifecycle.ts `RoomView`, type-checked below) plus the worker's own fields. Read by the
 * storm's monitor and the doctor.
 */
import type { RoomView as LifecycleRoomView } from '../kv/lifecycle.js';

/** One room as GET /debug/rooms shows it (JSON: ids and states are plain strings). */
export interface RoomView {
  room: string;
  rid: string;
  role: string;
  state: string;
  phase: string;
  age_ms: number;
  deadline_ms: number | null;
  peer: string | null;
  fail_reason?: string | null;
  step?: string | null;
  timeline: { at: number; state: string; phase: string; why: string }[];
}

/** Every row the lifecycle writes is a `RoomView` of this module: a compile-time check, no code. */
type Holds<T extends true> = T;
export type LifecycleRowFits = Holds<LifecycleRoomView extends RoomView ? true : false>;
