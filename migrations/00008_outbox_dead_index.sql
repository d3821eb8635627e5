-- +goose Up

-- outbox_dead_idx backs every query of dead events: the backlog figures the
-- dispatcher reads at the start and end of each invocation (also `fifobox
-- status` and make local's progress line), `fifobox dead list` and
-- requeue-dead. Without it each of them scanned the whole outbox, sent rows
-- included: 135 ms at 37,000 rows, and growing with retention. Dead events
-- are rare, so the index is tiny; a sent row never enters it, and claims
-- stay HOT (they do not change state).
--
-- On a large existing outbox, build it first without blocking writers
-- (CREATE INDEX CONCURRENTLY outbox_dead_idx ON outbox (id) WHERE state = 'dead');
-- this migration then does nothing.
CREATE INDEX IF NOT EXISTS outbox_dead_idx ON outbox (id) WHERE state = 'dead';

-- +goose Down
DROP INDEX outbox_dead_idx;
