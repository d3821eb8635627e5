package inbox

import (
	"fmt"

	"github.com/jackc/pgx/v5"
)

// Strict order's bookkeeping: table inbox_held (migration 00010) lists, per
// consumer and message group, the dead-lettered message that holds the group
// and every message sent to the DLQ behind it, in arrival order.
const (
	sqlHold = `INSERT INTO inbox_held (consumer, group_id, message_key, event_id, sequence, class)
VALUES ($1, $2, $3, $4, $5, $6)
ON CONFLICT (consumer, group_id, message_key) DO UPDATE SET class = EXCLUDED.class WHERE inbox_held.class = 'last-receive'`
	sqlReleaseHeld = `DELETE FROM inbox_held WHERE consumer = $1 AND group_id = $2 AND message_key = $3`
	// Before a record's last receive its group is held (committed at once):
	// if the attempt fails, or the invocation dies, SQS moves the record to
	// the DLQ and the hold already keeps the group's later records behind it.
	sqlPreHold = `INSERT INTO inbox_held (consumer, group_id, message_key, event_id, sequence, class)
SELECT $1, g, k, NULLIF(e, '')::uuid, NULLIF(s, 0), 'last-receive'
FROM unnest($2::text[], $3::text[], $4::text[], $5::bigint[]) WITH ORDINALITY AS t(g, k, e, s, n)
ORDER BY n
ON CONFLICT (consumer, group_id, message_key) DO NOTHING`
	// Whether any of the batch's groups is held. The Lambdas run every
	// statement unprepared (RDS Proxy), and this costs a fraction of
	// sqlLoadHolds' planning (~0.15 ms a batch on the build machine).
	sqlAnyHeld = `SELECT EXISTS (SELECT 1 FROM inbox_held WHERE consumer = $1 AND group_id = ANY($2::text[]))`
	// The first rows (up to $3) of each group in the batch, by position.
	sqlLoadHolds = `SELECT g.group_id, h.message_key, coalesce(h.event_id::text, ''), coalesce(h.sequence, 0), h.class
FROM unnest($2::text[]) AS g(group_id)
CROSS JOIN LATERAL (
    SELECT message_key, event_id, sequence, class, position FROM inbox_held
    WHERE consumer = $1 AND group_id = g.group_id ORDER BY position LIMIT $3) h
ORDER BY g.group_id, h.position`
)

type heldRow struct {
	key, eventID string
	seq          int64
	class        string
}

// holdSet is what the batch knows of its groups' holds. A nil *holdSet
// (relaxed order) holds nothing.
type holdSet struct {
	rows map[string][]heldRow // first rows by position, per group
	more map[string]bool      // the group has rows beyond those loaded
}

func newHoldSet() *holdSet {
	return &holdSet{rows: map[string][]heldRow{}, more: map[string]bool{}}
}

// scanHolds reads the result of sqlLoadHolds, the next in br.
func scanHolds(br pgx.BatchResults, limit int) (*holdSet, error) {
	rows, err := br.Query()
	if err != nil {
		return nil, fmt.Errorf("read held groups: %w", err)
	}
	s := newHoldSet()
	for rows.Next() {
		var g string
		var r heldRow
		if err := rows.Scan(&g, &r.key, &r.eventID, &r.seq, &r.class); err != nil {
			rows.Close()
			return nil, fmt.Errorf("read held groups: %w", err)
		}
		s.rows[g] = append(s.rows[g], r)
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("read held groups: %w", err)
	}
	for g, rs := range s.rows {
		s.more[g] = len(rs) >= limit
	}
	return s, nil
}

// head returns the group's first held row.
func (s *holdSet) head(group string) (heldRow, bool) {
	if s == nil || len(s.rows[group]) == 0 {
		return heldRow{}, false
	}
	return s.rows[group][0], true
}

// blocked reports whether the record with key must wait behind the group's
// first held row (which it returns).
func (s *holdSet) blocked(group, key string) (heldRow, bool) {
	head, ok := s.head(group)
	return head, ok && head.key != key
}

// isHead reports whether key is its held group's first row.
func (s *holdSet) isHead(group, key string) bool {
	head, ok := s.head(group)
	return ok && head.key == key
}

// pop drops the group's first row (released in the batch transaction).
func (s *holdSet) pop(group string) {
	if s != nil && len(s.rows[group]) > 0 {
		s.rows[group] = s.rows[group][1:]
	}
}

// add appends a row the batch listed, unless it is listed already or the
// group has rows beyond those loaded (then it cannot be first in this batch).
func (s *holdSet) add(group string, r heldRow) {
	if s == nil || s.more[group] {
		return
	}
	for _, x := range s.rows[group] {
		if x.key == r.key {
			return
		}
	}
	s.rows[group] = append(s.rows[group], r)
}
