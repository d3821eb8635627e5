package outbox

import (
	"context"
	"errors"
	"fmt"
	"time"
)

// Backlog is a snapshot of the outbox for operators and alarms.
type Backlog struct {
	// Pending counts events not yet sent (due, claimed, retrying or parked behind a dead event).
	Pending int64
	// InFlight counts pending events currently claimed by a dispatcher.
	InFlight int64
	// Dead counts events that gave up; each parks its aggregate.
	Dead int64
	// ParkedAggregates counts aggregates held back by a dead event.
	ParkedAggregates int64
	// OldestPendingAge is how long the oldest pending event has waited (publish lag); 0 if none.
	OldestPendingAge time.Duration
}

// Stats reads the current backlog.
func Stats(ctx context.Context, db DB) (Backlog, error) {
	var b Backlog
	var age *float64
	err := db.QueryRow(ctx, sqlStats).Scan(&b.Pending, &b.Dead, &b.ParkedAggregates, &b.InFlight, &age)
	if err != nil {
		return Backlog{}, fmt.Errorf("outbox stats: %w", err)
	}
	if age != nil && *age > 0 {
		b.OldestPendingAge = time.Duration(*age * float64(time.Second))
	}
	return b, nil
}

// Prune deletes sent events older than olderThan, at most batch rows per
// statement so no single transaction grows large, until none are left or ctx
// ends. It returns how many rows it deleted.
func Prune(ctx context.Context, db DB, olderThan time.Duration, batch int) (int64, error) {
	if olderThan < 0 {
		return 0, errors.New("prune: olderThan must not be negative")
	}
	if batch < 1 {
		return 0, errors.New("prune: batch must be at least 1")
	}
	cutoff := time.Now().Add(-olderThan)
	var total int64
	for {
		if err := ctx.Err(); err != nil {
			return total, fmt.Errorf("prune: %w", err)
		}
		tag, err := db.Exec(ctx, sqlPrune, cutoff, batch)
		if err != nil {
			return total, fmt.Errorf("prune sent events: %w", err)
		}
		total += tag.RowsAffected()
		if tag.RowsAffected() < int64(batch) {
			return total, nil
		}
	}
}
