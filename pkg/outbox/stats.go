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
	// DueEvents counts unsent events that can go now or are in flight: not
	// backing off, not parked. What the publish-lag and backlog alarms watch.
	DueEvents int64
	// BackingOffEvents counts unsent events of aggregates whose head waits
	// out a retry backoff.
	BackingOffEvents int64
	// ParkedEvents counts unsent events held behind a dead head, the dead
	// head included.
	ParkedEvents int64
	// RetryingAggregates counts aggregates whose head failed retryably and
	// has not been published since: nonzero for long means the broker (or
	// its KMS key, or the VPC endpoint) keeps failing.
	RetryingAggregates int64
	// OldestDueAge is how long the oldest due event has waited since it was
	// enqueued (publish lag, parked and backing-off events excluded); 0 if none.
	OldestDueAge time.Duration
	// InFlight counts aggregates whose run is currently claimed by a dispatcher.
	InFlight int64
	// Dead counts events that gave up; each parks its aggregate.
	Dead int64
	// ParkedAggregates counts aggregates held back by a dead event.
	ParkedAggregates int64
	// OldestPendingAge is how long the oldest pending event has waited (publish lag); 0 if none.
	OldestPendingAge time.Duration
	// StrandedEvents counts events written around the enqueue path (an
	// insert that set aggregate_seq itself, which only the table owner can)
	// that are unsent after StrandedAfter and that no claim can reach (no
	// ready or dead head at or below them, no wake-up). They are never
	// published until RebuildHeads (`fifobox repair-heads`) derives their
	// heads.
	StrandedEvents int64
	// OldestTransactionAge is how long the oldest transaction holding back
	// vacuum has been open on the server, in any database of the cluster
	// (fifobox_oldest_transaction, migrations/00035): while it lasts, the
	// dead row versions every event leaves are kept, and claims slow down.
	// 0 if none.
	OldestTransactionAge time.Duration
	// OldestTransactionPartial says OldestTransactionAge covers only the
	// sessions of the migration owner's role: the owner of
	// fifobox_oldest_transaction lacks pg_read_all_stats.
	OldestTransactionPartial bool
}

// StrandedAfter is how long an unreachable pending event waits before it
// counts as stranded: far longer than a wake-up takes to be consumed (the
// next claim), so a live event is never counted.
const StrandedAfter = 300 * time.Second

// Stats reads the current backlog.
func Stats(ctx context.Context, db DB) (Backlog, error) {
	var b Backlog
	var age, dueAge *float64
	err := db.QueryRow(ctx, sqlStats).Scan(&b.Pending, &b.Dead, &b.ParkedAggregates, &b.InFlight, &age,
		&b.DueEvents, &b.BackingOffEvents, &b.ParkedEvents, &b.RetryingAggregates, &dueAge, &b.StrandedEvents)
	if err != nil {
		return Backlog{}, fmt.Errorf("outbox stats: %w", err)
	}
	b.OldestPendingAge = seconds(age)
	b.OldestDueAge = seconds(dueAge)
	var txAge float64
	var seesAll bool
	if err := db.QueryRow(ctx, sqlOldestTransaction).Scan(&txAge, &seesAll); err != nil {
		return Backlog{}, fmt.Errorf("outbox stats: oldest transaction: %w", err)
	}
	b.OldestTransactionAge = seconds(&txAge)
	b.OldestTransactionPartial = !seesAll
	return b, nil
}

func seconds(s *float64) time.Duration {
	if s == nil || *s <= 0 {
		return 0
	}
	return time.Duration(*s * float64(time.Second))
}

// Prune deletes sent (and discarded) events older than olderThan, reading
// at most batch rows per statement so no single transaction grows large,
// until it reaches events younger than that or ctx ends. It returns how many
// rows it deleted. A sent event's age is its creation time (the time it was
// sent is not recorded: a mark only moves its aggregate's head), or for rows
// written before migration 00030, when it was sent.
func Prune(ctx context.Context, db DB, olderThan time.Duration, batch int) (int64, error) {
	if olderThan < 0 {
		return 0, errors.New("prune: olderThan must not be negative")
	}
	if batch < 1 {
		return 0, errors.New("prune: batch must be at least 1")
	}
	cutoff := time.Now().Add(-olderThan)
	var total, after int64
	for {
		if err := ctx.Err(); err != nil {
			return total, fmt.Errorf("prune: %w", err)
		}
		var (
			n     int64
			last  *int64
			young bool
		)
		if err := db.QueryRow(ctx, sqlPrune, after, batch, cutoff).Scan(&n, &last, &young); err != nil {
			return total, fmt.Errorf("prune sent events: %w", err)
		}
		total += n
		if last == nil || young {
			return total, nil
		}
		after = *last
	}
}
