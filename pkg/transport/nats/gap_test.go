package nats

import (
	"log/slog"
	"slices"
	"testing"

	"github.com/nats-io/nats.go/jetstream"
)

// gapMsg is a delivery the runner's filters do not select (so dispatch
// acknowledges it without the engine), with its consumer sequence.
type gapMsg struct {
	jetstream.Msg
	seq   uint64
	acked *[]uint64
}

func (m gapMsg) Metadata() (*jetstream.MsgMetadata, error) {
	return &jetstream.MsgMetadata{Sequence: jetstream.SequencePair{Consumer: m.seq, Stream: m.seq}, NumDelivered: 1}, nil
}
func (m gapMsg) Subject() string { return "elsewhere.event" }
func (m gapMsg) Ack() error      { *m.acked = append(*m.acked, m.seq); return nil }

// A skipped consumer sequence is a delivery lost in transit: dispatch
// reports it once and takes nothing after it (no ack, no engine), so what
// follows is redelivered with the lost one instead of overtaking it. The
// count goes on from the consumer's last delivery before the session, so a
// session's first delivery can show a gap too (a pull request on a
// partitioned connection took the ones before it).
func TestDispatchStopsAtALostDelivery(t *testing.T) {
	for _, tt := range []struct {
		name  string
		seqs  []uint64
		acked []uint64
	}{
		{"mid-session", []uint64{7, 8, 9, 11, 12, 10}, []uint64{7, 8, 9}},
		{"the session's first delivery", []uint64{8, 9, 7}, nil},
	} {
		t.Run(tt.name, func(t *testing.T) {
			var acked []uint64
			lost := 0
			r := &Runner{
				cfg:          Config{Logger: slog.New(slog.DiscardHandler), Topology: Topology{SubjectPrefix: "fifobox"}},
				c:            Consumer{Name: "c", Filters: []string{"order.*"}},
				onLost:       func() { lost++ },
				lastDelivery: 6, // the consumer's last delivery before the session
			}
			for _, seq := range tt.seqs {
				r.dispatch(nil, gapMsg{seq: seq, acked: &acked})
			}
			if !slices.Equal(acked, tt.acked) {
				t.Fatalf("acknowledged %v, want the deliveries before the gap only (%v)", acked, tt.acked)
			}
			if lost != 1 {
				t.Fatalf("reported the loss %d times, want once", lost)
			}
		})
	}
}
