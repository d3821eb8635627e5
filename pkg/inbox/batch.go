package inbox

import (
	"context"
	"errors"
	"fmt"

	"github.com/fifobox/fifobox/pkg/envelope"
)

// Batch applies several events for one consumer in one transaction, each
// under a savepoint of its own, as the SQS handler does for a Lambda batch:
// an event's savepoint and inbox claim go to PostgreSQL in one round trip,
// and one COMMIT covers the batch. Consumers that gather deliveries
// themselves (the broker runners) use it to pay a transaction per batch
// instead of per message.
//
// Nothing a Batch applied is durable, and no message of it may be
// acknowledged, until Commit returns nil. A Batch is not safe for
// concurrent use; it holds one connection from Begin to Commit or Rollback.
type Batch struct {
	db       DB
	consumer string
	tx       batchTx
}

// NewBatch returns an empty batch for consumer; its transaction starts with
// the first Apply.
func NewBatch(db DB, consumer string) (*Batch, error) {
	switch {
	case db == nil:
		return nil, errors.New("inbox batch: db is nil")
	case consumer == "":
		return nil, errors.New("inbox batch: consumer name is empty")
	}
	return &Batch{db: db, consumer: consumer}, nil
}

// Apply claims e for the batch's consumer and, unless it was applied before
// (Duplicate), runs fn in the batch's transaction, as Process does. If the
// claim or fn fails, e's claim and fn's writes are rolled back to e's
// savepoint, the events applied before it in the batch stay, and the error
// is returned unchanged (use envelope.Permanent for errors no retry can fix); a
// panic in fn is such an error, not a crash. Once
// the transaction itself is unusable every later Apply fails.
func (b *Batch) Apply(ctx context.Context, e envelope.Envelope, fn SideEffect) (Outcome, error) {
	if err := b.tx.begin(ctx, b.db); err != nil {
		return 0, err
	}
	claimed, err := b.tx.claim(ctx, b.consumer, e)
	if err != nil {
		return 0, err
	}
	if !claimed {
		return Duplicate, nil
	}
	if err := b.tx.effect(ctx, fn); err != nil {
		b.tx.undo(ctx)
		return 0, err
	}
	return Applied, nil
}

// Commit commits everything applied; nil means every Applied outcome is
// durable. After an error nothing of the batch was applied.
func (b *Batch) Commit(ctx context.Context) error {
	if err := b.tx.commit(ctx); err != nil {
		b.tx.rollback(ctx)
		return fmt.Errorf("inbox batch commit: %w", err)
	}
	return nil
}

// Rollback discards the batch (a no-op after Commit).
func (b *Batch) Rollback(ctx context.Context) { b.tx.rollback(ctx); b.tx.tx = nil }
