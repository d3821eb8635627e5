// Package invoketest serves AWS Lambda's Invoke API for tests: the redrive
// function's real handler behind the endpoint `fifobox --via-lambda` (and
// `aws lambda invoke`) call, so the CLI's Lambda path runs end to end
// without AWS.
package invoketest

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"

	"github.com/aws/aws-lambda-go/lambdacontext"
)

// Handler runs one invocation's payload (lambdafn/redrive.Handler.Invoke).
type Handler func(ctx context.Context, payload []byte) ([]byte, error)

// Server is a Lambda Invoke endpoint; Payloads records what it was invoked with.
type Server struct {
	*httptest.Server
	mu       sync.Mutex
	payloads [][]byte
}

// Payloads returns the payloads of every invocation so far.
func (s *Server) Payloads() [][]byte {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([][]byte(nil), s.payloads...)
}

// New serves POST /2015-03-31/functions/<name>/invocations with h, each
// invocation with a Lambda context (request id), answering as Lambda does:
// the response payload, or the error as {"errorMessage", "errorType"} with
// X-Amz-Function-Error.
func New(tb testing.TB, h Handler) *Server {
	s := &Server{}
	s.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodPost || !strings.HasPrefix(r.URL.Path, "/2015-03-31/functions/") || !strings.HasSuffix(r.URL.Path, "/invocations") {
			http.Error(w, `{"message":"not an Invoke request"}`, http.StatusNotFound)
			return
		}
		body, _ := io.ReadAll(r.Body)
		s.mu.Lock()
		s.payloads = append(s.payloads, body)
		n := len(s.payloads)
		s.mu.Unlock()
		ctx := lambdacontext.NewContext(r.Context(), &lambdacontext.LambdaContext{AwsRequestID: "test-request-" + string(rune('0'+n%10))})
		out, err := h(ctx, body)
		if err != nil {
			w.Header().Set("X-Amz-Function-Error", "Unhandled")
			b, _ := json.Marshal(map[string]string{"errorMessage": err.Error(), "errorType": "errorString"})
			_, _ = w.Write(b)
			return
		}
		_, _ = w.Write(out)
	}))
	tb.Cleanup(s.Close)
	return s
}
