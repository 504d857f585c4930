"""Routes of this dialect (being written)."""
from fastapi import APIRouter

router = APIRouter()
