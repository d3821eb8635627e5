package outbox_test

import (
	"context"
	"encoding/json"
	"fmt"
	"sort"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/fifobox/fifobox/pkg/envelope"
	"github.com/fifobox/fifobox/pkg/outbox"
	"github.com/fifobox/fifobox/pkg/outbox/outboxtest"
)

func event(aggregateID string, n int) envelope.Envelope {
	id, _ := uuid.NewV7()
	return envelope.Envelope{
		ID:            id.String(),
		Type:          "order.updated",
		OccurredAt:    time.Now().UTC(),
		AggregateType: "order",
		AggregateID:   aggregateID,
		SchemaVersion: 1,
		Payload:       json.RawMessage(fmt.Sprintf(`{"n":%d,"note":"%s"}`, n, "x")),
	}
}

// enqueue commits events in one transaction.
func enqueue(t testing.TB, db outboxTestDB, events ...envelope.Envelope) {
	t.Helper()
	ctx := context.Background()
	err := pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error { return outbox.Enqueue(ctx, tx, events...) })
	if err != nil {
		t.Fatalf("enqueue: %v", err)
	}
}

type outboxTestDB interface {
	outbox.DB
	Begin(ctx context.Context) (pgx.Tx, error)
}

func count(t testing.TB, db outbox.DB, where string) int {
	t.Helper()
	var n int
	if err := db.QueryRow(context.Background(), "SELECT count(*) FROM outbox_events WHERE "+where).Scan(&n); err != nil {
		t.Fatalf("count %s: %v", where, err)
	}
	return n
}

func headCount(t testing.TB, db outbox.DB, where string) int {
	t.Helper()
	var n int
	if err := db.QueryRow(context.Background(), "SELECT count(*) FROM outbox_heads WHERE "+where).Scan(&n); err != nil {
		t.Fatalf("count heads %s: %v", where, err)
	}
	return n
}

// checkOrder asserts that per aggregate the acknowledgements run 1..want[agg]
// in order. With allowDup, an event may be acknowledged again after it was
// first acknowledged (a crash between publish and mark re-publishes the
// claimed run; SNS drops such copies by deduplication id), but no event may
// be acknowledged before every earlier event of its aggregate was.
func checkOrder(t *testing.T, acks []outboxtest.Ack, want map[string]int, allowDup bool) (dups int) {
	t.Helper()
	last := map[string]int64{}
	for i, a := range acks {
		prev := last[a.AggregateID]
		switch {
		case a.Sequence == prev+1:
			last[a.AggregateID] = a.Sequence
		case a.Sequence <= prev && allowDup:
			dups++
		default:
			t.Fatalf("ack %d: aggregate %s got sequence %d after %d (order violated or duplicate)", i, a.AggregateID, a.Sequence, prev)
		}
	}
	var missing []string
	for agg, n := range want {
		if last[agg] != int64(n) {
			missing = append(missing, fmt.Sprintf("%s: acked up to %d of %d", agg, last[agg], n))
		}
	}
	sort.Strings(missing)
	if len(missing) > 0 {
		t.Fatalf("%d aggregates incomplete, e.g. %v", len(missing), missing[:min(5, len(missing))])
	}
	if len(last) != len(want) {
		t.Fatalf("acks cover %d aggregates, want %d", len(last), len(want))
	}
	return dups
}
