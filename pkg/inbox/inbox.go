package inbox

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/fifobox/fifobox/pkg/envelope"
)

// DB is what Process needs: *pgxpool.Pool satisfies it.
type DB interface {
	Begin(ctx context.Context) (pgx.Tx, error)
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults
}

// Outcome of Process.
type Outcome int

const (
	// Applied: the side effect ran and committed with the inbox claim.
	Applied Outcome = iota + 1
	// Duplicate: the event was applied before; nothing was done.
	Duplicate
)

func (o Outcome) String() string {
	switch o {
	case Applied:
		return "applied"
	case Duplicate:
		return "duplicate"
	}
	return "unknown"
}

// SideEffect applies one event inside the inbox transaction.
type SideEffect func(ctx context.Context, tx pgx.Tx) error

const (
	sqlPrune = `DELETE FROM inbox WHERE ctid IN (
    SELECT ctid FROM inbox WHERE processed_at < $1 ORDER BY processed_at LIMIT $2)`
)

// Process applies e's side effect for consumer exactly once. In one
// transaction it first claims (consumer, event id) with INSERT ... ON
// CONFLICT DO NOTHING, then runs fn. A concurrent duplicate waits on the
// claim's unique key and then finds it taken, so two deliveries at once
// still apply once. If fn fails, the claim rolls back with it and the error
// is returned unchanged (use envelope.Permanent to mark errors no retry can fix).
func Process(ctx context.Context, db DB, consumer string, e envelope.Envelope, fn SideEffect) (Outcome, error) {
	if consumer == "" {
		return 0, errors.New("inbox: consumer name is empty")
	}
	var out Outcome
	err := pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
		q := defaultClaimer.query(consumer, e)
		tag, err := tx.Exec(ctx, q.SQL, q.Arguments...)
		if err != nil {
			return fmt.Errorf("inbox claim: %w", err)
		}
		if tag.RowsAffected() == 0 {
			out = Duplicate
			return nil
		}
		if err := fn(ctx, tx); err != nil {
			return err
		}
		out = Applied
		return nil
	})
	if err != nil {
		return 0, err
	}
	return out, nil
}

// Prune deletes inbox rows processed before olderThan ago, batch rows per
// statement, and returns how many it deleted. olderThan must be at least
// MinRetention (default 30 days): a pruned event delivered again (a DLQ
// redrive, a late duplicate) would be applied again.
func Prune(ctx context.Context, db DB, olderThan time.Duration, batch int) (int64, error) {
	if olderThan < MinRetention {
		return 0, fmt.Errorf("inbox prune: olderThan %s: keep inbox rows longer than any DLQ keeps a message, at least %s (default %s)", olderThan, MinRetention, DefaultRetention)
	}
	if batch < 1 {
		return 0, errors.New("inbox prune: batch must be at least 1")
	}
	cutoff := time.Now().Add(-olderThan)
	var total int64
	for {
		tag, err := db.Exec(ctx, sqlPrune, cutoff, batch)
		if err != nil {
			return total, fmt.Errorf("inbox prune: %w", err)
		}
		total += tag.RowsAffected()
		if tag.RowsAffected() < int64(batch) {
			return total, nil
		}
		if err := ctx.Err(); err != nil {
			return total, err
		}
	}
}

// DefaultRetention is how long inbox rows are kept by default: longer than
// any DLQ keeps a message (14 days at most), so a redriven message that was
// applied before is still recognised.
const DefaultRetention = 30 * 24 * time.Hour

// MinRetention is the shortest retention Prune accepts (and the redrive
// function's prune, whoever invokes it): a day longer than the 14 days an
// SQS DLQ keeps a message at most (topology.DLQRetention). A message
// redriven from a DLQ is recognised as applied only while its inbox row
// exists; with a shorter retention it could be applied twice.
const MinRetention = 15 * 24 * time.Hour
