package outbox_test

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/fifobox/fifobox/internal/pgtest"
	"github.com/fifobox/fifobox/pkg/envelope"
	"github.com/fifobox/fifobox/pkg/outbox"
)

func backendCPU(pid int) time.Duration {
	b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	s := string(b)
	f := strings.Fields(s[strings.LastIndex(s, ")")+2:])
	u, _ := strconv.ParseInt(f[11], 10, 64)
	st, _ := strconv.ParseInt(f[12], 10, 64)
	return time.Duration(u+st) * 10 * time.Millisecond
}

func TestTmpEnqueueCost(t *testing.T) {
	db := pgtest.New(t)
	ctx := context.Background()
	conn, err := db.Pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	var pid int
	if err := conn.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&pid); err != nil {
		t.Fatal(err)
	}
	payload := json.RawMessage(`{"amount_cents":1200,"currency":"EUR","items":[{"sku":"A-1","qty":2}]}`)
	for _, batch := range []int{1, 10} {
		n := 6000
		txs := n / batch
		c0, w0 := backendCPU(pid), time.Now()
		for i := 0; i < txs; i++ {
			evs := make([]envelope.Envelope, batch)
			for j := range evs {
				evs[j] = envelope.Envelope{ID: uuid.Must(uuid.NewV7()).String(), Type: "order.updated", OccurredAt: time.Now(),
					AggregateType: "order", AggregateID: fmt.Sprintf("o-%d", (i*batch+j)%1000), TenantID: "acme", SchemaVersion: 1, Payload: payload}
			}
			if err := pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error { return outbox.Enqueue(ctx, tx, evs...) }); err != nil {
				t.Fatal(err)
			}
		}
		cpu, wall := backendCPU(pid)-c0, time.Since(w0)
		fmt.Printf("batch %d: backend CPU %.1f us/event, wall %.1f us/event\n", batch, float64(cpu.Microseconds())/float64(n), float64(wall.Microseconds())/float64(n))
	}
}
