-- +goose Up

-- The outbox is a queue: most rows change within seconds of being written.
-- Analyze and vacuum it by rows changed rather than by a fraction of its
-- (mostly sent) history, so the planner's estimate of pending rows follows a
-- burst within one autovacuum round and dead row versions are cleaned
-- promptly. (A claim planned with a small, stale estimate reads every pending
-- row instead of one batch; see README, Performance.)
ALTER TABLE outbox SET (
    autovacuum_analyze_scale_factor = 0,
    autovacuum_analyze_threshold    = 5000,
    autovacuum_vacuum_scale_factor  = 0,
    autovacuum_vacuum_threshold     = 10000
);

-- +goose Down
ALTER TABLE outbox RESET (
    autovacuum_analyze_scale_factor,
    autovacuum_analyze_threshold,
    autovacuum_vacuum_scale_factor,
    autovacuum_vacuum_threshold
);
