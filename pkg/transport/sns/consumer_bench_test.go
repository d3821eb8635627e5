package sns_test

import (
	"context"
	"fmt"
	"os"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/aws/aws-lambda-go/events"
	"github.com/jackc/pgx/v5"

	"github.com/fifobox/fifobox/internal/pgtest"
	"github.com/fifobox/fifobox/pkg/envelope"
	"github.com/fifobox/fifobox/pkg/readmodel"
	"github.com/fifobox/fifobox/pkg/transport/sns"
)

// BenchmarkConsumer measures messages/s through the SQS batch handler with
// the inbox, beside the same side effect (the orders read model upsert)
// applied the same way without the inbox (a transaction per batch, a
// savepoint per record), in one run. Batches of 10 as Lambda
// delivers them, 4 concurrent "instances".
//
//	go test -run '^$' -bench BenchmarkConsumer -benchtime 20000x ./pkg/inbox/
func BenchmarkConsumer(b *testing.B) {
	const instances = 4
	makeBatches := func(n int) []events.SQSEvent {
		var out []events.SQSEvent
		var cur events.SQSEvent
		for i := 0; i < n; i++ {
			id := fmt.Sprintf("order-%06d", i)
			e, _ := envelope.New("order.created", "order", id, readmodel.OrderEvent{OrderID: id, CustomerID: "c-1", AmountCents: 1200, Currency: "EUR"})
			e.Sequence = 1
			body, _ := e.Encode()
			cur.Records = append(cur.Records, events.SQSMessage{MessageId: fmt.Sprint(i), Body: string(body),
				Attributes: map[string]string{"MessageGroupId": id}})
			if len(cur.Records) == 10 {
				out = append(out, cur)
				cur = events.SQSEvent{}
			}
		}
		if len(cur.Records) > 0 {
			out = append(out, cur)
		}
		return out
	}
	run := func(b *testing.B, batches []events.SQSEvent, handle func(events.SQSEvent) error) float64 {
		var next atomic.Int64
		var wg sync.WaitGroup
		start := time.Now()
		for w := 0; w < instances; w++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for {
					i := next.Add(1) - 1
					if int(i) >= len(batches) {
						return
					}
					if err := handle(batches[i]); err != nil {
						b.Error(err)
						return
					}
				}
			}()
		}
		wg.Wait()
		rate := float64(b.N) / time.Since(start).Seconds()
		b.ReportMetric(rate, "msgs/s")
		return rate
	}
	var with, without float64
	// Interleaved rounds, best of each, as in the emulator benchmark; round
	// 0 only warms up (PostgreSQL's caches, the Go runtime's heap).
	for round := 0; round <= 3; round++ {
		warm := round == 0
		b.Run("without-inbox", func(b *testing.B) {
			db := pgtest.New(b)
			batches := makeBatches(b.N)
			b.ResetTimer()
			// The handler's transaction shape without the inbox claim: one
			// transaction per batch, a savepoint per record (so one record's
			// failure can be undone alone), the side effect.
			ctx := context.Background()
			r := run(b, batches, func(ev events.SQSEvent) error {
				return pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
					for _, rec := range ev.Records {
						e, err := envelope.Decode([]byte(rec.Body))
						if err != nil {
							return err
						}
						if _, err := tx.Exec(ctx, "SAVEPOINT record"); err != nil {
							return err
						}
						if err := readmodel.Apply(ctx, tx, e); err != nil {
							return err
						}
					}
					return nil
				})
			})
			if !warm {
				without = max(without, r)
			}
		})
		b.Run("with-inbox", func(b *testing.B) {
			db := pgtest.New(b)
			h, _ := sns.NewHandler(db.Pool, &fakeDLQ{}, readmodel.Apply, sns.HandlerConfig{Consumer: "orders-projection", DLQURL: "d"})
			batches := makeBatches(b.N)
			b.ResetTimer()
			r := run(b, batches, func(ev events.SQSEvent) error {
				resp, err := h.Handle(context.Background(), ev)
				if err == nil && len(resp.BatchItemFailures) > 0 {
					err = fmt.Errorf("%d failures", len(resp.BatchItemFailures))
				}
				return err
			})
			if !warm {
				with = max(with, r)
			}
		})
	}
	if with > 0 && without > 0 {
		fmt.Fprintf(os.Stdout, "\nconsumer: %.0f msgs/s with the inbox, %.0f msgs/s same side effect without it: overhead %.2fx (targets: >= 2000 msgs/s, < 1.3x; best of 3 rounds after a warm-up round)\n\n",
			with, without, without/with)
	}
}
