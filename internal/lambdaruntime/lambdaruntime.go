// Package lambdaruntime runs a Lambda bootstrap binary the way Lambda's
// provided.al2023 runtime does, for tests: a Server implements the Lambda
// Runtime API (version 2018-06-01, the four endpoints a runtime calls), and
// Start launches the binary with AWS_LAMBDA_RUNTIME_API pointing at it and
// the environment Lambda defines (PlatformEnv).
//
//	GET  /2018-06-01/runtime/invocation/next            the next event, with its request id,
//	                                                    deadline, function ARN and trace id headers
//	POST /2018-06-01/runtime/invocation/{id}/response   the invocation's result
//	POST /2018-06-01/runtime/invocation/{id}/error      the invocation's error document
//	POST /2018-06-01/runtime/init/error                 a failed init, before the first next
//
// The server checks the runtime keeps to the protocol (answers only the
// invocation it was given, once; reports init errors only during init) and
// fails the test otherwise. One execution environment handles one
// invocation at a time, as in Lambda.
//
// Reference: https://docs.aws.amazon.com/lambda/latest/dg/runtimes-api.html
package lambdaruntime

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

// API paths, after the address in AWS_LAMBDA_RUNTIME_API.
const (
	PathNext      = "/2018-06-01/runtime/invocation/next"
	PathInitError = "/2018-06-01/runtime/init/error"
	pathInvoke    = "/2018-06-01/runtime/invocation/"
)

// Runtime API headers.
const (
	HeaderRequestID   = "Lambda-Runtime-Aws-Request-Id"
	HeaderDeadlineMs  = "Lambda-Runtime-Deadline-Ms"
	HeaderFunctionARN = "Lambda-Runtime-Invoked-Function-Arn"
	HeaderTraceID     = "Lambda-Runtime-Trace-Id"
	HeaderErrorType   = "Lambda-Runtime-Function-Error-Type"
)

// ErrorDoc is Lambda's error document (the body of the error endpoints).
type ErrorDoc struct {
	ErrorMessage string   `json:"errorMessage"`
	ErrorType    string   `json:"errorType"`
	StackTrace   []string `json:"stackTrace,omitempty"`
}

// InitFailure is what the runtime posted to /runtime/init/error.
type InitFailure struct {
	ErrorType string // the Lambda-Runtime-Function-Error-Type header
	Doc       ErrorDoc
	Raw       []byte
}

// Invocation is one event for the function.
type Invocation struct {
	// Payload is the event. nil is an Invoke without a payload (the CDK
	// deploy trigger's): Lambda then delivers "{}", and so does the server.
	Payload []byte
	// Deadline is sent as Lambda-Runtime-Deadline-Ms; zero: 10 s from now.
	Deadline time.Time
	// FunctionARN is sent as Lambda-Runtime-Invoked-Function-Arn; default
	// arn:aws:lambda:us-east-1:123456789012:function:<the server's function name>.
	FunctionARN string
}

// Result is how an invocation ended.
type Result struct {
	RequestID string
	Deadline  time.Time
	// Response is the body posted to /response (nil if none).
	Response []byte
	// Err is the document posted to /error; ErrorType its header.
	Err       *ErrorDoc
	ErrorType string
	// At is when the runtime posted, TimedOut whether that was after the
	// deadline or never (Lambda would have stopped the invocation).
	At       time.Time
	TimedOut bool
}

// Server is a Lambda Runtime API for one execution environment.
type Server struct {
	tb           testing.TB
	functionName string
	ln           net.Listener
	srv          *http.Server

	queue chan *pending // invocations waiting for GET next

	mu        sync.Mutex
	current   *pending // handed out by next, not answered yet
	nexts     int      // GET next calls (the first ends init)
	initErr   *InitFailure
	initErrCh chan struct{}
	ready     chan struct{} // closed at the first GET next
	closed    chan struct{}
}

type pending struct {
	id   string
	inv  Invocation
	done chan Result
}

// NewServer starts a Runtime API on 127.0.0.1 for a function named
// functionName; it closes when the test ends.
func NewServer(tb testing.TB, functionName string) *Server {
	tb.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatalf("lambdaruntime: listen: %v", err)
	}
	s := &Server{
		tb: tb, functionName: functionName, ln: ln,
		queue: make(chan *pending, 16), initErrCh: make(chan struct{}),
		ready: make(chan struct{}), closed: make(chan struct{}),
	}
	mux := http.NewServeMux()
	mux.HandleFunc("GET "+PathNext, s.next)
	mux.HandleFunc("POST "+pathInvoke+"{id}/response", s.respond)
	mux.HandleFunc("POST "+pathInvoke+"{id}/error", s.invokeError)
	mux.HandleFunc("POST "+PathInitError, s.initError)
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		s.violation("unexpected request %s %s", r.Method, r.URL.Path)
		writeJSON(w, http.StatusNotFound, ErrorDoc{ErrorMessage: "not found", ErrorType: "NotFound"})
	})
	s.srv = &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	go func() { _ = s.srv.Serve(ln) }()
	tb.Cleanup(s.Close)
	return s
}

// Addr is the value for AWS_LAMBDA_RUNTIME_API (host:port, no scheme).
func (s *Server) Addr() string { return s.ln.Addr().String() }

// Close stops the server; a runtime blocked in GET next gets a 500
// ("container error", after which a runtime exits).
func (s *Server) Close() {
	select {
	case <-s.closed:
		return
	default:
		close(s.closed)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	_ = s.srv.Shutdown(ctx)
}

func (s *Server) violation(format string, args ...any) {
	s.tb.Errorf("lambdaruntime: runtime broke the protocol: "+format, args...)
}

// Ready is closed when the runtime first asks for an event: init is over.
func (s *Server) Ready() <-chan struct{} { return s.ready }

// InitFailed is closed when the runtime has posted an init error.
func (s *Server) InitFailed() <-chan struct{} { return s.initErrCh }

// InitError returns the init error the runtime posted, if any.
func (s *Server) InitError() *InitFailure {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.initErr
}

// Invoke hands inv to the runtime and waits for its answer, at most until
// the deadline plus grace (to tell a late answer from none).
func (s *Server) Invoke(ctx context.Context, inv Invocation, grace time.Duration) (Result, error) {
	if inv.Deadline.IsZero() {
		inv.Deadline = time.Now().Add(10 * time.Second)
	}
	if inv.FunctionARN == "" {
		inv.FunctionARN = "arn:aws:lambda:us-east-1:123456789012:function:" + s.functionName
	}
	p := &pending{id: newRequestID(), inv: inv, done: make(chan Result, 1)}
	select {
	case s.queue <- p:
	case <-ctx.Done():
		return Result{}, ctx.Err()
	}
	wait := time.NewTimer(time.Until(inv.Deadline) + grace)
	defer wait.Stop()
	select {
	case r := <-p.done:
		r.TimedOut = r.At.After(inv.Deadline)
		return r, nil
	case <-wait.C:
		return Result{RequestID: p.id, Deadline: inv.Deadline, TimedOut: true}, nil
	case <-ctx.Done():
		return Result{}, ctx.Err()
	}
}

func (s *Server) next(w http.ResponseWriter, r *http.Request) {
	s.mu.Lock()
	s.nexts++
	if s.nexts == 1 {
		close(s.ready)
	}
	if s.current != nil {
		s.violation("GET next while invocation %s has no response or error", s.current.id)
		s.current = nil
	}
	s.mu.Unlock()
	var p *pending
	select {
	case p = <-s.queue:
	case <-s.closed:
		writeJSON(w, http.StatusInternalServerError, ErrorDoc{ErrorMessage: "runtime API closed", ErrorType: "Runtime.Closed"})
		return
	case <-r.Context().Done():
		return
	}
	s.mu.Lock()
	s.current = p
	s.mu.Unlock()
	payload := p.inv.Payload
	if payload == nil {
		payload = []byte("{}")
	}
	h := w.Header()
	h.Set(HeaderRequestID, p.id)
	h.Set(HeaderDeadlineMs, strconv.FormatInt(p.inv.Deadline.UnixMilli(), 10))
	h.Set(HeaderFunctionARN, p.inv.FunctionARN)
	h.Set(HeaderTraceID, "Root=1-"+strconv.FormatInt(time.Now().Unix(), 16)+"-"+p.id[:24]+";Parent="+p.id[:16]+";Sampled=0")
	h.Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusOK)
	_, _ = w.Write(payload)
}

// take returns the invocation id answers, once.
func (s *Server) take(id string) *pending {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.current == nil || s.current.id != id {
		return nil
	}
	p := s.current
	s.current = nil
	return p
}

func (s *Server) respond(w http.ResponseWriter, r *http.Request) {
	id := r.PathValue("id")
	body, err := io.ReadAll(r.Body)
	if err != nil {
		writeJSON(w, http.StatusBadRequest, ErrorDoc{ErrorMessage: err.Error(), ErrorType: "InvalidRequestContent"})
		return
	}
	p := s.take(id)
	if p == nil {
		s.violation("response for %s, which is not the invocation in progress", id)
		writeJSON(w, http.StatusBadRequest, ErrorDoc{ErrorMessage: "invalid request id " + id, ErrorType: "InvalidRequestID"})
		return
	}
	p.done <- Result{RequestID: id, Deadline: p.inv.Deadline, Response: body, At: time.Now()}
	writeJSON(w, http.StatusAccepted, map[string]string{"status": "OK"})
}

func (s *Server) invokeError(w http.ResponseWriter, r *http.Request) {
	id := r.PathValue("id")
	doc, raw, ok := readErrorDoc(w, r)
	if !ok {
		return
	}
	p := s.take(id)
	if p == nil {
		s.violation("error for %s, which is not the invocation in progress: %s", id, raw)
		writeJSON(w, http.StatusBadRequest, ErrorDoc{ErrorMessage: "invalid request id " + id, ErrorType: "InvalidRequestID"})
		return
	}
	p.done <- Result{RequestID: id, Deadline: p.inv.Deadline, Err: &doc, ErrorType: r.Header.Get(HeaderErrorType), At: time.Now()}
	writeJSON(w, http.StatusAccepted, map[string]string{"status": "OK"})
}

func (s *Server) initError(w http.ResponseWriter, r *http.Request) {
	doc, raw, ok := readErrorDoc(w, r)
	if !ok {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.nexts > 0 || s.initErr != nil {
		s.violation("init error after init ended or reported twice: %s", raw)
		writeJSON(w, http.StatusForbidden, ErrorDoc{ErrorMessage: "init error outside init", ErrorType: "InvalidStateTransition"})
		return
	}
	s.initErr = &InitFailure{ErrorType: r.Header.Get(HeaderErrorType), Doc: doc, Raw: raw}
	close(s.initErrCh)
	writeJSON(w, http.StatusAccepted, map[string]string{"status": "OK"})
}

// readErrorDoc reads Lambda's error document. Runtimes may send any body;
// Lambda then builds the error from the header, and so do we.
func readErrorDoc(w http.ResponseWriter, r *http.Request) (ErrorDoc, []byte, bool) {
	raw, err := io.ReadAll(r.Body)
	if err != nil {
		writeJSON(w, http.StatusBadRequest, ErrorDoc{ErrorMessage: err.Error(), ErrorType: "InvalidRequestContent"})
		return ErrorDoc{}, nil, false
	}
	var doc ErrorDoc
	if json.Unmarshal(raw, &doc) != nil || doc.ErrorMessage == "" && doc.ErrorType == "" {
		doc = ErrorDoc{ErrorType: r.Header.Get(HeaderErrorType), ErrorMessage: string(raw)}
	}
	return doc, raw, true
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}

func newRequestID() string {
	b := make([]byte, 16)
	_, _ = rand.Read(b)
	h := hex.EncodeToString(b)
	return h[:8] + "-" + h[8:12] + "-" + h[12:16] + "-" + h[16:20] + "-" + h[20:]
}

// PlatformEnv is the environment Lambda gives every provided.al2023
// function besides its own variables (AWS_LAMBDA_RUNTIME_API is added by
// Start): region, function identity, credentials (dummies: the test points
// the SDK at an emulator), and the runtime's paths.
func PlatformEnv(functionName string, memoryMB int) []string {
	return []string{
		"AWS_REGION=us-east-1",
		"AWS_DEFAULT_REGION=us-east-1",
		"AWS_ACCESS_KEY_ID=test",
		"AWS_SECRET_ACCESS_KEY=test",
		"AWS_SESSION_TOKEN=test",
		"AWS_LAMBDA_FUNCTION_NAME=" + functionName,
		"AWS_LAMBDA_FUNCTION_VERSION=$LATEST",
		"AWS_LAMBDA_FUNCTION_MEMORY_SIZE=" + strconv.Itoa(memoryMB),
		"AWS_LAMBDA_LOG_GROUP_NAME=/aws/lambda/" + functionName,
		"AWS_LAMBDA_LOG_STREAM_NAME=2026/01/01/[$LATEST]" + strings.ReplaceAll(newRequestID(), "-", ""),
		"AWS_LAMBDA_INITIALIZATION_TYPE=on-demand",
		"_HANDLER=bootstrap",
		"LAMBDA_TASK_ROOT=/var/task",
		"LAMBDA_RUNTIME_DIR=/var/runtime",
		"LANG=en_US.UTF-8",
		"TZ=:UTC",
		"PATH=/usr/local/bin:/usr/bin/:/bin:/opt/bin",
		"LD_LIBRARY_PATH=/var/lang/lib:/lib64:/usr/lib64:/var/runtime:/var/runtime/lib:/var/task:/var/task/lib:/opt/lib",
	}
}

// Function is a running bootstrap process.
type Function struct {
	cmd    *exec.Cmd
	out    *lockedBuffer
	exited chan struct{}
	err    error
}

// Start runs the bootstrap at path with exactly env (plus
// AWS_LAMBDA_RUNTIME_API) and this server as its Runtime API. The process is
// killed when the test ends; its output is logged if the test failed.
func (s *Server) Start(path string, env []string) *Function {
	s.tb.Helper()
	f := &Function{out: &lockedBuffer{}, exited: make(chan struct{})}
	f.cmd = exec.Command(path)
	f.cmd.Env = append(append([]string{}, env...), "AWS_LAMBDA_RUNTIME_API="+s.Addr())
	f.cmd.Stdout, f.cmd.Stderr = f.out, f.out
	if err := f.cmd.Start(); err != nil {
		s.tb.Fatalf("lambdaruntime: start %s: %v", path, err)
	}
	go func() {
		f.err = f.cmd.Wait()
		close(f.exited)
	}()
	s.tb.Cleanup(func() {
		_ = f.cmd.Process.Kill()
		<-f.exited
		if s.tb.Failed() {
			s.tb.Logf("output of %s:\n%s", path, f.Output())
		}
	})
	return f
}

// Exited is closed when the process has ended.
func (f *Function) Exited() <-chan struct{} { return f.exited }

// ExitErr is the process's exit error (nil for status 0); valid after Exited.
func (f *Function) ExitErr() error { return f.err }

// Output is what the process wrote to stdout and stderr so far (its logs
// and EMF metric lines, as CloudWatch Logs would receive them).
func (f *Function) Output() string { return f.out.String() }

// WaitExit waits up to d for the process to end.
func (f *Function) WaitExit(d time.Duration) error {
	select {
	case <-f.exited:
		return nil
	case <-time.After(d):
		return errors.New("process still running after " + d.String())
	}
}

type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// String describes a result for test messages.
func (r Result) String() string {
	switch {
	case r.Err != nil:
		return fmt.Sprintf("error %s: %s", r.Err.ErrorType, r.Err.ErrorMessage)
	case r.Response != nil:
		return "response " + string(r.Response)
	}
	return "no answer"
}
