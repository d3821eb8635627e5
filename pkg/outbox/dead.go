package outbox

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/google/uuid"
)

// DeadSelection selects dead events: by EventIDs, or by AggregateType with an
// optional created_at range [Since, Until).
type DeadSelection struct {
	EventIDs      []string
	AggregateType string
	Since, Until  *time.Time
}

func (s DeadSelection) args() ([]string, error) {
	ids := make([]string, 0, len(s.EventIDs))
	for _, v := range s.EventIDs {
		u, err := uuid.Parse(v)
		if err != nil {
			return nil, fmt.Errorf("event id %q: %w", v, err)
		}
		ids = append(ids, u.String())
	}
	if len(ids) == 0 && s.AggregateType == "" {
		return nil, errors.New("select dead events by event ids or by aggregate type")
	}
	if s.Since != nil && s.Until != nil && !s.Since.Before(*s.Until) {
		return nil, errors.New("since must be before until")
	}
	return ids, nil
}

// RequeueDead makes the selected dead events pending again (attempts reset)
// and un-parks their aggregates, which resume in order from them. Run it in
// the caller's transaction to audit it atomically. It returns how many
// events it requeued.
func RequeueDead(ctx context.Context, db DB, sel DeadSelection) (int64, error) {
	ids, err := sel.args()
	if err != nil {
		return 0, fmt.Errorf("requeue dead: %w", err)
	}
	var n int64
	if err := db.QueryRow(ctx, sqlRequeueDead, ids, sel.AggregateType, sel.Since, sel.Until).Scan(&n); err != nil {
		return 0, fmt.Errorf("requeue dead: %w", err)
	}
	return n, nil
}

// DiscardDead gives up on the selected dead events for good (state
// 'discarded', reason appended to their last error): they are never
// published, and their aggregates resume with the events after them. For an
// event no broker will ever accept. It returns how many events it discarded.
func DiscardDead(ctx context.Context, db DB, sel DeadSelection, reason string) (int64, error) {
	if reason == "" {
		return 0, errors.New("discard dead: reason is required")
	}
	ids, err := sel.args()
	if err != nil {
		return 0, fmt.Errorf("discard dead: %w", err)
	}
	var n int64
	if err := db.QueryRow(ctx, sqlDiscardDead, ids, sel.AggregateType, sel.Since, sel.Until, reason).Scan(&n); err != nil {
		return 0, fmt.Errorf("discard dead: %w", err)
	}
	return n, nil
}

// RebuildHeads re-derives every head from the outbox (outbox_rebuild_heads):
// a repair after rows were written by hand. Safe while dispatchers run (it
// leaves claimed heads alone). It returns how many heads it wrote.
func RebuildHeads(ctx context.Context, db DB) (int64, error) {
	var n int64
	if err := db.QueryRow(ctx, sqlRebuildHeads).Scan(&n); err != nil {
		return 0, fmt.Errorf("rebuild heads: %w", err)
	}
	return n, nil
}
