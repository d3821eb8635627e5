package outbox

import (
	"context"
	"fmt"
)

// The operator's view of failing publishes: why aggregates retry or died
// (ErrorTexts) and making backing-off aggregates due at once (RetryNow).
// Their SQL is kept here rather than in sql.go so the operator's queries
// read together; they use the heads of migrations/00009.

// ErrorText is one distinct publish error and how many events carry it.
type ErrorText struct {
	// Kind is "retrying" (the head event of an aggregate backing off after a
	// retryable failure) or "dead".
	Kind string
	// Text is the event's last_error as the dispatcher recorded it (no
	// payloads: publish errors never contain the body).
	Text string
	// Count is how many events carry it.
	Count int64
	// NewestID is the outbox id of the most recent event with it.
	NewestID int64
}

// sqlErrorTexts reads the distinct errors of retrying heads and dead
// events, most frequent first, at most $1. Retrying heads are read through
// the heads (O(aggregates backing off)); dead events through their partial
// index (migrations/00008).
const sqlErrorTexts = `
SELECT kind, text, n, newest FROM (
    SELECT 'retrying' AS kind, coalesce(o.last_error, '') AS text, count(*) AS n, max(o.id) AS newest
    FROM outbox_heads h
    JOIN outbox o ON o.aggregate_type = h.aggregate_type AND o.aggregate_id = h.aggregate_id AND o.aggregate_seq = h.next_seq
    WHERE h.state = 'ready' AND h.retry_since IS NOT NULL AND o.state = 'pending'
    GROUP BY 2
    UNION ALL
    SELECT 'dead', coalesce(last_error, ''), count(*), max(id)
    FROM outbox WHERE state = 'dead'
    GROUP BY 2
) e
ORDER BY n DESC, newest DESC
LIMIT $1`

// ErrorTexts returns the distinct errors of retrying and dead events, most
// frequent first, at most limit.
func ErrorTexts(ctx context.Context, db DB, limit int) ([]ErrorText, error) {
	rows, err := db.Query(ctx, sqlErrorTexts, limit)
	if err != nil {
		return nil, fmt.Errorf("outbox error texts: %w", err)
	}
	defer rows.Close()
	var out []ErrorText
	for rows.Next() {
		var e ErrorText
		if err := rows.Scan(&e.Kind, &e.Text, &e.Count, &e.NewestID); err != nil {
			return nil, fmt.Errorf("outbox error texts: %w", err)
		}
		out = append(out, e)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("outbox error texts: %w", err)
	}
	return out, nil
}

// RetrySelection chooses backing-off aggregates for RetryNow; empty fields
// select every one.
type RetrySelection struct {
	AggregateType string
	AggregateIDs  []string
	// ErrorContains selects aggregates whose head event's last error
	// contains this text.
	ErrorContains string
}

// sqlRetrySelect finds the backing-off heads a selection takes: ready,
// unclaimed, not yet due, retrying. $1 aggregate type (” any), $2 ids, $3
// error text. Locked in key order (every writer of heads locks in that
// order), skipping a head a dispatcher holds right now (it is being
// claimed or marked: not backing off any more).
const sqlRetrySelect = `
SELECT h.aggregate_type, h.aggregate_id, greatest(a.last_seq - h.next_seq + 1, 0) AS unsent
FROM outbox_heads h
JOIN outbox_aggregates a ON a.aggregate_type = h.aggregate_type AND a.aggregate_id = h.aggregate_id
LEFT JOIN outbox o ON o.aggregate_type = h.aggregate_type AND o.aggregate_id = h.aggregate_id AND o.aggregate_seq = h.next_seq
WHERE h.state = 'ready' AND h.claim_token IS NULL AND h.retry_since IS NOT NULL AND h.due_at > now()
  AND ($1 = '' OR h.aggregate_type = $1)
  AND (cardinality($2::text[]) = 0 OR h.aggregate_id = ANY($2::text[]))
  AND ($3 = '' OR strpos(coalesce(o.last_error, ''), $3) > 0)
ORDER BY h.aggregate_type, h.aggregate_id`

// RetryNow makes the selected backing-off aggregates due now, so the next
// claim publishes their head events (the backoff's delay is skipped; how
// long they have failed, which decides when an event goes dead, is kept).
// With dryRun it only counts them. It returns the aggregates and their
// unsent events. Run it in the caller's transaction to audit it atomically.
func RetryNow(ctx context.Context, db DB, sel RetrySelection, dryRun bool) (aggregates, events int64, err error) {
	ids := sel.AggregateIDs
	if ids == nil {
		ids = []string{} // never NULL: cardinality(NULL) is NULL
	}
	q := sqlRetrySelect
	if !dryRun {
		q = `WITH sel AS (` + sqlRetrySelect + ` FOR NO KEY UPDATE OF h SKIP LOCKED), upd AS (
    UPDATE outbox_heads h SET due_at = now() FROM sel
    WHERE h.aggregate_type = sel.aggregate_type AND h.aggregate_id = sel.aggregate_id
    RETURNING 1)
SELECT (SELECT count(*) FROM upd), coalesce((SELECT sum(unsent) FROM sel), 0)::bigint`
	} else {
		q = `SELECT count(*), coalesce(sum(unsent), 0)::bigint FROM (` + sqlRetrySelect + `) sel`
	}
	if err := db.QueryRow(ctx, q, sel.AggregateType, ids, sel.ErrorContains).Scan(&aggregates, &events); err != nil {
		return 0, 0, fmt.Errorf("retry now: %w", err)
	}
	return aggregates, events, nil
}
